"""LoRA through peft: adapters injected into a plain model in place (names stay the model's, plus peft's
`base_layer` / `lora_A` / `lora_B`), base weights frozen, and merged back for export.

Every adapter is drawn from a generator seeded by (seed, parameter name), so a pipeline stage, a
tensor-parallel rank (which splits the adapter after it is drawn) and a single process all start from the
same adapters. Tensor parallelism splits each adapter with its base layer (tensor_parallel/plan.py)."""

from __future__ import annotations

import math

import torch
import torch.nn as nn


def linear_names(model: nn.Module) -> set[str]:
    return {n.rpartition(".")[2] for n, m in model.named_modules() if isinstance(m, nn.Linear)}


def check_targets(model: nn.Module, lora_cfg) -> None:
    """`lora.target_modules` must name linear layers of `model` (the whole model, before any pipeline cut)."""
    names = linear_names(model)
    unknown = sorted(set(lora_cfg.target_modules) - names)
    if unknown:
        raise ValueError(f"lora.target_modules {unknown} name no nn.Linear in {type(model).__name__}; "
                         f"its linear layers are {sorted(names)}")


def apply_lora(model: nn.Module, lora_cfg, seed: int = 0, check: bool = True) -> int:
    """Inject adapters on the modules named in `lora_cfg.target_modules`; returns the trainable parameter count.

    `check=False` (a pipeline stage): the targets were checked on the whole model, and a stage holding none of
    them gets no adapters."""
    try:
        import peft
    except ImportError:
        raise ValueError("lora.enabled needs the peft package (pip install 'peft>=0.13'); install it or turn "
                         "LoRA off") from None
    if check:
        check_targets(model, lora_cfg)
    targets = set(lora_cfg.target_modules)
    if targets & linear_names(model):
        cfg = peft.LoraConfig(r=lora_cfg.r, lora_alpha=lora_cfg.alpha, lora_dropout=lora_cfg.dropout,
                              target_modules=list(lora_cfg.target_modules))
        # peft asks transformers for the checkpoint-key conversions of the transformers modules inside, which read
        # the root's base_model_prefix: a pipeline stage holding LLaVA's modules has none (its keys are the
        # model's own paths, so no prefix is right), and it is taken away again after
        bare = not hasattr(model, "base_model_prefix")
        if bare:
            model.base_model_prefix = ""
        try:
            peft.inject_adapter_in_model(cfg, model)
        finally:
            if bare:
                del model.base_model_prefix
        init_adapters(model, seed)
    for name, p in model.named_parameters():
        p.requires_grad = ".lora_" in name
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


@torch.no_grad()
def init_adapter(name: str, p: torch.Tensor, seed: int) -> None:
    """peft's initialisation (A ~ U(+-1/sqrt(fan_in)), i.e. kaiming_uniform with a=sqrt(5); B = 0), drawn per
    name so that it does not depend on which adapters this process builds or in which order."""
    if ".lora_B." in name:
        p.zero_()
        return
    from bunsan.models.llama import seed_for
    bound = 1.0 / math.sqrt(p.shape[1])
    g = torch.Generator().manual_seed(seed_for(seed, name))
    p.copy_(torch.empty(p.shape, dtype=torch.float32).uniform_(-bound, bound, generator=g))


def init_adapters(model: nn.Module, seed: int) -> None:
    for name, p in model.named_parameters():
        if is_adapter(name) and not p.is_meta:
            init_adapter(name, p, seed)


def adapter_aware(init_parameter):
    """A model's init_parameter(name, tensor, seed) that also knows adapter names: a base weight is drawn under
    its plain name (the same numbers as without LoRA), an adapter as above. For models built on meta."""
    def init(name: str, p: torch.Tensor, seed: int | None = None) -> None:
        if is_adapter(name):
            init_adapter(name, p, seed or 0)
        else:
            init_parameter(name.replace(".base_layer.", "."), p, seed)
    return init


def merge_lora(state: dict[str, torch.Tensor], alpha: float, r: int) -> dict[str, torch.Tensor]:
    """A plain state dict from one with adapters: W = W_base + (alpha / r) B A, adapter keys dropped."""
    out, scale = {}, alpha / r
    for key, t in state.items():
        if is_adapter(key):
            continue
        if key.endswith(".base_layer.weight"):
            stem = key[: -len(".base_layer.weight")]
            a, b = state[f"{stem}.lora_A.default.weight"], state[f"{stem}.lora_B.default.weight"]
            out[f"{stem}.weight"] = (t.float() + scale * (b.float() @ a.float())).to(t.dtype)
        else:
            out[key] = t
    return out
