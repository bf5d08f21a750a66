"""`deepspeed.runtime`: what user scripts import from it (utils, zero, data_pipeline)."""
