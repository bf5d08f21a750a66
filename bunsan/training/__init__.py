"""What `bunsan train` adds around the engine: data, tokenizer, metrics and the loop (loop.py)."""
