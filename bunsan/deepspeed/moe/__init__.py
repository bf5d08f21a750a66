"""`deepspeed.moe`: DeepSpeed's mixture-of-experts layer (layer.py: `MoE`, its gate in gating.py) and the
parameter-group helpers (utils.py), on bunsan's expert parallelism."""
