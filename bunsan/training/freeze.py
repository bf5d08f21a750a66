"""`train.freeze`: parameters kept as they are, chosen by name pattern, frozen before the engine wraps the
model (so ZeRO, LoRA and the optimizer see them frozen from the start, as `requires_grad_(False)` in the
Python API).

A pattern is a shell glob (fnmatch: `*`, `?`, `[...]`) matched against a parameter's whole dotted name or any
run of its dotted parts: `vision_tower` freezes every parameter under a module of that name
(`model.vision_tower.encoder.layers.0.mlp.fc1.weight`), `*.bias` every bias, `model.layers.[0-3].*` the first
four decoder layers. A pattern that matches nothing is an error naming it (a typo would train what was meant
to stay).
"""

from __future__ import annotations

from fnmatch import fnmatchcase

import torch.nn as nn

__all__ = ["freeze", "matches"]


def matches(name: str, pattern: str) -> bool:
    """Whether `pattern` names the parameter `name`, as a whole or as a run of its dotted parts."""
    if fnmatchcase(name, pattern):
        return True
    parts = name.split(".")
    return any(fnmatchcase(".".join(parts[i:j]), pattern)
               for i in range(len(parts)) for j in range(i + 1, len(parts) + 1))


def freeze(model: nn.Module, patterns: list[str], adapters: bool = False) -> int:
    """Freeze the parameters `patterns` name (by any of their names: a tied weight has two); the number frozen.
    `adapters`: LoRA adds trainable parameters later, so freezing every one of these is allowed."""
    if not patterns:
        return 0
    names = [(n, p) for n, p in model.named_parameters(remove_duplicate=False)]
    for pattern in patterns:
        if not any(matches(n, pattern) for n, _ in names):
            shown = sorted({".".join(n.split(".")[:3]) for n, _ in names})[:12]
            raise ValueError(f"train.freeze pattern {pattern!r} matches no parameter of the model; its parameters "
                             f"are named like {shown}: a glob over the dotted names, or a module's name "
                             "(vision_tower, multi_modal_projector)")
    frozen = {id(p): p for n, p in names if any(matches(n, pat) for pat in patterns)}
    for p in frozen.values():
        p.requires_grad_(False)
    if not adapters and all(not p.requires_grad for _, p in names):
        raise ValueError(f"train.freeze {patterns} freezes every parameter of the model; nothing would train")
    return len(frozen)
