"""The `bunsan` command line (main.py); one module per command; launch.py starts processes."""
