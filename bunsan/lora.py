"""LoRA through peft: adapters injected into a plain model in place (names stay the model's, plus peft's
`base_layer` / `lora_A` / `lora_B`), base weights frozen, and merged back for export."""

from __future__ import annotations

import torch
import torch.nn as nn


def apply_lora(model: nn.Module, lora_cfg) -> int:
    """Inject adapters on the modules named in `lora_cfg.target_modules`; returns the trainable parameter count."""
    try:
        import peft
    except ImportError:
        raise ValueError("lora.enabled needs the peft package (pip install 'peft>=0.13'); install it or turn "
                         "LoRA off") from None
    names = {n.rpartition(".")[2] for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    unknown = sorted(set(lora_cfg.target_modules) - names)
    if unknown:
        raise ValueError(f"lora.target_modules {unknown} name no nn.Linear in {type(model).__name__}; "
                         f"its linear layers are {sorted(names)}")
    cfg = peft.LoraConfig(r=lora_cfg.r, lora_alpha=lora_cfg.alpha, lora_dropout=lora_cfg.dropout,
                          target_modules=list(lora_cfg.target_modules))
    peft.inject_adapter_in_model(cfg, model)
    for name, p in model.named_parameters():
        p.requires_grad = ".lora_" in name
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def merge_lora(state: dict[str, torch.Tensor], alpha: float, r: int) -> dict[str, torch.Tensor]:
    """A plain state dict from one with adapters: W = W_base + (alpha / r) B A, adapter keys dropped."""
    out, scale = {}, alpha / r
    for key, t in state.items():
        if ".lora_A." in key or ".lora_B." in key:
            continue
        if key.endswith(".base_layer.weight"):
            stem = key[: -len(".base_layer.weight")]
            a, b = state[f"{stem}.lora_A.default.weight"], state[f"{stem}.lora_B.default.weight"]
            out[f"{stem}.weight"] = (t.float() + scale * (b.float() @ a.float())).to(t.dtype)
        else:
            out[key] = t
    return out
