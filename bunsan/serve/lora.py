"""Many LoRA adapters on one served base model, chosen per request by `model` and batched together (vLLM's
multi-LoRA serving, `--lora-modules NAME=PATH`): peft adapter folders, bunsan's own (`lora.save: adapter`)
included.

Every nn.Linear of the decoder (not the head) becomes a MultiLoRALinear holding all adapters' A and B
matrices stacked ([adapters, r, in] and [adapters, out, r], ranks zero-padded to --max-lora-rank; slot 0 is
the base model, all zeros). Before each forward the batcher sets every token's adapter slot; a layer adds
scale_i * B_i A_i x to the tokens of adapter i, so rows of different adapters run in one batch. The KV cache's
prefix cache keys each adapter's blocks apart (its `root`), since an adapter changes the keys and values too.
Adapters load at start, or at run time through vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter when
--allow-runtime-lora is given; an adapter still in use by an open request is not unloaded.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import torch
import torch.nn as nn
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from bunsan.serve.body import ClientGone, read_json
from bunsan.serve.errors import ApiError, shown
from bunsan.serve.requests import Strict, validated


class MultiLoRALinear(nn.Module):
    def __init__(self, base: nn.Linear, adapters: "AdapterSet"):
        super().__init__()
        self.base, self.adapters = base, adapters
        w = base.weight
        shape = (adapters.capacity + 1, adapters.max_rank)
        self.register_buffer("lora_a", torch.zeros(*shape, base.in_features, dtype=w.dtype, device=w.device))
        self.register_buffer("lora_b", torch.zeros(shape[0], base.out_features, shape[1], dtype=w.dtype,
                                                   device=w.device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [1, tokens, in]: each token adds its adapter's scale * B A x (the adapters' tokens in one matmul
        each)."""
        y = self.base(x)
        slots = self.adapters.rows              # on the CPU, one per token
        if slots is None or not bool(slots.any()):
            return y
        flat_x, flat_y = x.reshape(-1, x.shape[-1]), y.view(-1, y.shape[-1])
        for slot in slots.unique().tolist():
            if slot:
                at = torch.nonzero(slots == slot).flatten().to(x.device)
                delta = flat_x[at] @ self.lora_a[slot].T @ self.lora_b[slot].T
                flat_y.index_add_(0, at, delta, alpha=float(self.adapters.scales[slot]))
        return y


class AdapterSet:
    """The adapters a served model can run: names, their slots, and the per-forward rows."""

    def __init__(self, model, capacity: int, max_rank: int):
        self.capacity, self.max_rank = capacity, max_rank
        self.scales = torch.zeros(capacity + 1)
        self.slots: dict[str, int] = {}            # adapter name -> slot (1..capacity)
        self.roots: dict[str, int] = {}            # adapter name -> its prefix-cache root (never reused)
        self.paths: dict[str, str] = {}
        self._roots = itertools.count(-1, -1)
        self.rows: torch.Tensor | None = None      # [tokens] slot per token of the forward about to run
        hf = getattr(model, "hf_model", None)
        root = model if hf is None else hf
        head = root.get_output_embeddings() if hf is not None else model.lm_head
        self.layers: dict[str, MultiLoRALinear] = {}
        for name, module in list(root.named_modules()):
            for child_name, child in list(module.named_children()):
                if type(child) is nn.Linear and child is not head:
                    full = f"{name}.{child_name}" if name else child_name
                    wrapped = MultiLoRALinear(child, self)
                    setattr(module, child_name, wrapped)
                    # adapter files name modules as transformers does: bunsan's Llama's under "model."
                    self.layers[full if hf is not None else f"model.{full}"] = wrapped

    def add(self, name: str, folder: str) -> None:
        """Load the peft adapter `folder` under `name`; a clear error if it does not fit."""
        from bunsan.checkpoint.adapter import adapter_dir, adapter_pairs
        from bunsan.checkpoint.store import CheckpointError
        from bunsan.models.model_dir import ModelFileError
        if name in self.slots:
            raise ValueError(f"an adapter named {name!r} is already loaded; unload it first or use another name")
        free = sorted(set(range(1, self.capacity + 1)) - set(self.slots.values()))
        if not free:
            raise ValueError(f"{self.capacity} adapters are loaded (--max-loras); unload one first")
        shapes = {stem: (layer.base.out_features, layer.base.in_features) for stem, layer in self.layers.items()}
        try:
            scale, pairs = adapter_pairs(adapter_dir(folder) or Path(folder), shapes)
        except (CheckpointError, ModelFileError, OSError) as e:      # (each names the file and what is wrong)
            raise ValueError(f"{folder} is not a LoRA adapter of this model: {e}") from None
        r = max(a.shape[0] for a, _ in pairs.values())
        if r > self.max_rank:
            raise ValueError(f"{folder}: rank {r} is above --max-lora-rank {self.max_rank}; restart with a larger one")
        slot = free[0]
        for layer in self.layers.values():           # (a slot reused: its old adapter's matrices go)
            layer.lora_a[slot].zero_()
            layer.lora_b[slot].zero_()
        for stem, (a, b) in pairs.items():
            layer = self.layers[stem]
            layer.lora_a[slot, :a.shape[0]] = a.to(layer.lora_a.dtype)
            layer.lora_b[slot, :, :a.shape[0]] = b.to(layer.lora_b.dtype)
        self.scales[slot] = scale
        self.slots[name], self.roots[name], self.paths[name] = slot, next(self._roots), str(folder)

    def remove(self, name: str) -> None:
        del self.slots[name], self.roots[name], self.paths[name]


def parse_lora_modules(items: list[str] | None) -> list[tuple[str, str]]:
    """--lora-modules NAME=PATH ... (a bare PATH is named after its folder)."""
    out = []
    for item in items or []:
        name, sep, path = item.partition("=")
        name, path = (name, path) if sep else (Path(item).name, item)
        if not name or not path:
            raise ValueError(f"--lora-modules {item!r} is not NAME=PATH")
        out.append((name, path))
    return out


class LoadBody(Strict):
    lora_name: str
    lora_path: str | None = None


class LoraRoutes:
    """vLLM's runtime adapter endpoints, over the Service's AdapterSet."""

    def __init__(self, service):
        self.service = service

    async def _body(self, http: HTTPRequest) -> LoadBody:
        s = self.service
        if s.adapters is None or not s.runtime_lora:
            raise ApiError(400, "loading adapters at run time is off; start bunsan serve with --allow-runtime-lora "
                                "(and --max-loras)")
        return validated(LoadBody, await read_json(http, s.body_limits))

    async def load(self, http: HTTPRequest) -> Response:
        s = self.service
        try:
            body = await self._body(http)
            if not body.lora_path:
                raise ApiError(400, "lora_path is missing: the adapter folder to load", param="lora_path")
            if body.lora_name in s.served and body.lora_name not in s.adapters.slots:
                raise ApiError(400, f"{shown(body.lora_name)} is the base model's name; choose another",
                               param="lora_name")
            try:
                s.adapters.add(body.lora_name, body.lora_path)
            except ValueError as e:
                raise ApiError(400, str(e), param="lora_path") from None
            s.served.append(body.lora_name)
        except ClientGone:
            return Response(status_code=499)
        except ApiError as e:
            return e.response()
        return JSONResponse({"status": "ok", "message": f"adapter {body.lora_name} loaded"})

    async def unload(self, http: HTTPRequest) -> Response:
        s = self.service
        try:
            body = await self._body(http)
            name = body.lora_name
            if name not in s.adapters.slots:
                raise ApiError(404, f"no adapter named {shown(name)} is loaded", param="lora_name")
            if s.adapter_open.get(name):
                raise ApiError(409, f"adapter {shown(name)} is in use by {s.adapter_open[name]} open sequence(s); "
                                    "retry when they end", param="lora_name")
            s.adapters.remove(name)
            s.served.remove(name)
        except ClientGone:
            return Response(status_code=499)
        except ApiError as e:
            return e.response()
        return JSONResponse({"status": "ok", "message": f"adapter {name} unloaded"})

    def routes(self) -> list[Route]:
        return [Route("/v1/load_lora_adapter", self.load, methods=["POST"]),
                Route("/v1/unload_lora_adapter", self.unload, methods=["POST"])]
