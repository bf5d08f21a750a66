"""The plain single-process PyTorch loop every parallel layout is checked against."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from bunsan.models import Llama, get_preset

VOCAB = 256


def tiny_model(seed: int = 0, **overrides) -> Llama:
    torch.manual_seed(seed)
    cfg = get_preset("tiny")
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return Llama(cfg)


def batches(steps: int, rows: int, seq: int = 32, seed: int = 1, ignore_frac: float = 0.0) -> list[dict]:
    """Random token batches (global batch of `rows` rows per step); some labels -100 when ignore_frac > 0."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (rows, seq + 1), generator=g)
        labels = ids[:, 1:].clone()
        if ignore_frac:
            labels[torch.rand(labels.shape, generator=g) < ignore_frac] = -100
        out.append({"input_ids": ids[:, :-1].contiguous(), "labels": labels})
    return out


def rank_slice(batch, rank: int, world: int):
    """This rank's rows of a dict batch, or of an (x, ..., y) tuple."""
    if isinstance(batch, tuple):
        n = batch[0].shape[0] // world
        return tuple(t[rank * n:(rank + 1) * n] for t in batch)
    n = batch["input_ids"].shape[0] // world
    return {k: v[rank * n:(rank + 1) * n] for k, v in batch.items()}


ADAM_EPS = 1e-5   # see make_optimizer


def make_optimizer(name: str, params, **kw):
    if name == "adamw":
        # eps (ADAM_EPS) 1e-5 rather than 1e-8: Adam divides each gradient element by its own magnitude, so elements
        # whose gradient sits at the fp32 noise floor (|g| ~ 1e-10, reduction-order noise ~ 1e-9) would
        # turn that noise into lr-sized weight differences whatever the layout. 1e-6 still lets single elements
        # drift where the CPU's kernels round differently. SGD cases test scale exactly.
        return torch.optim.AdamW(params, lr=kw.get("lr", 1e-3), weight_decay=kw.get("weight_decay", 0.01),
                                 eps=ADAM_EPS)
    if name == "sgd":
        return torch.optim.SGD(params, lr=kw.get("lr", 0.05), momentum=kw.get("momentum", 0.9))
    raise ValueError(name)


def optimizer_config(name: str) -> dict:
    if name == "adamw":
        return {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01, "eps": ADAM_EPS}}
    return {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}}


def reference_train(model, data: list[dict], opt_name: str, clip: float = 0.0):
    """Whole global batch per step, mean token loss, optional global-norm clipping. Returns (losses, state)."""
    opt = make_optimizer(opt_name, model.parameters())
    losses = []
    for batch in data:
        logits = model(batch["input_ids"])
        loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), batch["labels"].reshape(-1),
                               ignore_index=-100)
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def to_numpy(state: dict) -> dict:
    return {k: v.float().numpy() for k, v in state.items()}
