"""`deepspeed.runtime.data_pipeline`: the data-efficiency library. Its sequence-length curriculum is the config's
`data_efficiency` / `curriculum_learning` section; random-LTD and metric-based sampling are absent (absent.py):
importing them works, using them is an error naming them."""
