"""DeepSpeed's launcher package: the names accelerate reads from it (runner.py); bunsan's launcher is
`bunsan train --nproc` / torchrun, and `accelerate launch` through accelerate_launch.py."""
