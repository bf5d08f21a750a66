"""transformers 5's packed experts (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V3): how their module is
called, which bunsan's tensor- and expert-parallel hooks rewrite (tensor_parallel/hf_moe.py,
expert_parallel/hf_experts.py)."""

from __future__ import annotations

__all__ = ["experts_call_arguments"]


def experts_call_arguments(name: str, args: tuple, kwargs: dict) -> tuple:
    """(hidden_states, top_k_index, top_k_weights) of a call to transformers' packed experts `name`, however
    passed; any other call is an error (a hook that rewrites it would get it wrong)."""
    names = ("hidden_states", "top_k_index", "top_k_weights")
    given = dict(zip(names, args)) | {k: v for k, v in kwargs.items() if k in names}
    missing = [n for n in names if n not in given]
    if missing or len(args) + len(kwargs) != 3:
        raise ValueError(f"{name} was called with {len(args)} positional and {sorted(kwargs)} keyword arguments; "
                         "bunsan splits packed experts called as (hidden_states, top_k_index, top_k_weights)")
    return tuple(given[n] for n in names)
