"""Continuous batching over a KV cache of independent slots: the model side of `bunsan serve`.

Every request owns a slot of the cache, [slots, kv_heads, max_len, head_dim] per layer, and its own length.
A new request is prefilled alone into its slot (a prompt is many tokens, a decode step is one); then each
step runs one forward over every active request together, each row at its own position (rotary position
per row, an attention mask that hides other rows' lengths). A request leaves its slot when it ends (length,
end-of-sequence, cancelled) and the next waiting one takes it: no request waits for a whole batch to end.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from bunsan.models.generate import KVCache, layer_devices, next_token
from bunsan.models.llama import Llama
from bunsan.serve.tp import HEARTBEAT_S


class _SlotLayer:
    def __init__(self, view: "_SlotView", i: int):
        self.view, self.i = view, i
        self.attn_mask = view.on("mask", view.cache.k[i].device)   # beside the layer (a device map spreads them)

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write each row's new keys and values at its own positions; all its keys so far, padded to the
        longest row (the mask hides the padding)."""
        c, w = self.view.cache, self.view
        ck, cv = c.k[self.i], c.v[self.i]
        rows, at = w.on("rows", ck.device), w.on("at", ck.device)
        ck[rows[:, None], :, at] = k.transpose(1, 2)
        cv[rows[:, None], :, at] = v.transpose(1, 2)
        return ck[rows, :, :w.keys], cv[rows, :, :w.keys]


class _SlotView:
    """The cache as the model sees it for one forward over `rows`, each adding `new` tokens."""

    def __init__(self, cache: "SlotCache", rows: list[int], new: int):
        self.cache, self.rows = cache, torch.tensor(rows, dtype=torch.long)
        self.positions = cache.lengths[self.rows]                      # where each row's new tokens start
        self.at = self.positions[:, None] + torch.arange(new)          # [n, new] positions written
        self.keys = int(self.at.max()) + 1
        if self.keys > cache.max_len:
            raise ValueError(f"slot cache full: position {self.keys} > max_len {cache.max_len}")
        visible = torch.arange(self.keys)[None, None, :] <= self.at[:, :, None]   # causal, and no padding
        self.mask = visible[:, None]                                   # [n, 1, new, keys]
        self._on: dict = {}
        self.new = new

    def on(self, name: str, device: torch.device) -> torch.Tensor:
        """`rows`, `at` or `mask` (built on the CPU) on `device`: moved once per forward and device, shared by
        the layers there, instead of a host-to-device copy per layer."""
        key = (name, device)
        if key not in self._on:
            self._on[key] = getattr(self, name).to(device)
        return self._on[key]

    def layer(self, i: int) -> _SlotLayer:
        return _SlotLayer(self, i)

    def advance(self, n: int) -> None:
        self.cache.lengths[self.rows] += n


class SlotCache:
    def __init__(self, model: Llama, slots: int, max_len: int, kv_heads: int | None = None):
        # where the model starts: its rotary tables sit beside the embedding (under a device map too), so the
        # token ids go there and the positions are cut there
        self.device = model.rope_cos.device
        # generate's cache, one row per slot (each layer's beside the layer under a device map), in the weights'
        # dtype; the rows' own lengths replace its single position
        kv = KVCache(model.config, slots, max_len, device=self.device, dtype=next(model.parameters()).dtype,
                     num_kv_heads=kv_heads, layer_devices=layer_devices(model))
        self.k, self.v = kv.k, kv.v
        self.lengths = torch.zeros(slots, dtype=torch.long)
        self.max_len = max_len

    def view(self, rows: list[int], new: int) -> _SlotView:
        return _SlotView(self, rows, new)


@dataclass
class Request:
    """One completion. `emit(token id)` is called for every new token, `finish(reason)` once at the end
    ("stop", "length" or "error: ..."); both from the batcher's thread."""
    ids: list[int]
    max_tokens: int
    emit: callable
    finish: callable
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float = 1.0
    eos: int | None = None
    seed: int | None = None
    cancelled: bool = False
    generated: int = 0
    last: int = 0
    slot: int = -1
    generator: torch.Generator | None = field(default=None, repr=False)


def sample(logits: torch.Tensor, r: Request) -> int:
    """One row's next token as `generate` draws it, on the CPU, where the request's seeded generator lives."""
    return int(next_token(logits.float().cpu()[None], r.temperature, r.top_k, r.generator, r.top_p)[0])


class Batcher:
    """Runs requests on `model` with at most `slots` at once; `submit` from any thread, `run` on one."""

    def __init__(self, model: Llama, slots: int, max_len: int, kv_heads: int | None = None, leader=None):
        """`leader` (serve/tp.py): under tensor parallelism, announces every forward to the other ranks."""
        self.model, self.max_len, self.leader = model.eval(), max_len, leader
        self.fatal: str | None = None       # a failure that ends serving (a tensor-parallel rank died)
        self.on_fatal = None                # called once with it (the server shuts down)
        self.cache = SlotCache(model, slots, max_len, kv_heads)
        self.free = list(range(slots))[::-1]
        self.active: dict[int, Request] = {}
        self.waiting: deque[Request] = deque()
        self.lock, self.wake = threading.Lock(), threading.Event()
        self.stopped = False
        self.steps = 0

    def submit(self, r: Request) -> None:
        if len(r.ids) + r.max_tokens > self.max_len:
            raise ValueError(f"prompt of {len(r.ids)} tokens + max_tokens {r.max_tokens} exceeds the context of "
                             f"{self.max_len} tokens; shorten the prompt or ask for fewer tokens")
        if r.seed is not None:
            r.generator = torch.Generator().manual_seed(r.seed)
        with self.lock:
            self.waiting.append(r)
        self.wake.set()

    def load(self) -> tuple[int, int]:
        with self.lock:
            return len(self.active), len(self.waiting)

    def stop(self) -> None:
        self.stopped = True
        self.wake.set()

    def run(self) -> None:
        """The serving loop: admit waiting requests into free slots, one decode step for all, until stopped."""
        beat = time.monotonic()
        try:
            while not self.stopped:
                if not self.active and not self.waiting:
                    self.wake.wait(0.1)
                    self.wake.clear()
                    if self.leader is not None and time.monotonic() - beat > HEARTBEAT_S:   # rank 0 lives
                        beat = time.monotonic()
                        self._guard(self.leader.heartbeat)
                    continue
                self._admit()
                if not self.stopped:
                    self._step()
        except Exception as e:          # never die silently: every request still gets its answer below
            self.fatal = self.fatal or f"the batcher failed: {type(e).__name__}: {e}"
            self.stopped = True
        reason = f"error: {self.fatal}" if self.fatal else "error: the server is shutting down"
        for r in list(self.active.values()) + list(self.waiting):
            r.finish(reason)
        if self.leader is not None and not self.fatal:
            try:
                self._guard(self.leader.stop)
            except Exception:
                pass

    def _guard(self, fn, *args):
        """Run a collective step; if it fails under tensor parallelism, serving ends (the group is broken)."""
        try:
            return fn(*args)
        except Exception as e:
            if self.leader is None:
                raise
            self.fatal = f"tensor-parallel serving failed: {type(e).__name__}: {e}"
            self.stopped = True
            if self.on_fatal is not None:
                self.on_fatal(self.fatal)
            raise

    def _forward(self, rows: list[int], ids: torch.Tensor) -> torch.Tensor:
        ids = ids.to(self.cache.device)      # where the model starts (a device map moves it on from there)
        if self.leader is not None:
            self._guard(self.leader.forward, rows, self.cache.lengths[torch.tensor(rows)], ids)
        with torch.no_grad():
            return self._guard(lambda: self.model(ids, kv_cache=self.cache.view(rows, ids.shape[1])))

    def _admit(self) -> None:
        while self.free:
            with self.lock:
                if not self.waiting:
                    return
                r = self.waiting.popleft()
            if r.cancelled:
                r.finish("cancelled")
                continue
            r.slot = self.free.pop()
            self.cache.lengths[r.slot] = 0
            self.active[r.slot] = r           # running from its prefill on (health and limits count it)
            try:
                logits = self._forward([r.slot], torch.tensor([r.ids]))
                self._emit(r, sample(logits[0, -1], r))
            except Exception as e:        # this request's failure is its own; the others go on
                self._end(r, f"error: {type(e).__name__}: {e}")
                if self.fatal:
                    return

    def _step(self) -> None:
        rows = sorted(self.active)
        if not rows:
            return
        ids = torch.tensor([[self.active[s].last] for s in rows])
        try:
            logits = self._forward(rows, ids)[:, -1]
        except Exception as e:
            for s in rows:
                self._end(self.active[s], f"error: {type(e).__name__}: {e}")
            return
        self.steps += 1
        for j, s in enumerate(rows):
            r = self.active[s]
            try:
                self._emit(r, sample(logits[j], r))
            except Exception as e:        # a bad sample or decode ends this request only
                self._end(r, f"error: {type(e).__name__}: {e}")

    def _emit(self, r: Request, token: int) -> None:
        self.active[r.slot] = r
        if r.cancelled:
            return self._end(r, "cancelled")
        r.generated += 1
        r.last = token
        if r.eos is not None and token == r.eos:
            return self._end(r, "stop")
        r.emit(token)
        if r.cancelled:                     # a stop string seen by the caller
            return self._end(r, "stop")
        if r.generated >= r.max_tokens:
            return self._end(r, "length")

    def _end(self, r: Request, reason: str) -> None:
        self.active.pop(r.slot, None)
        if r.slot >= 0:
            self.free.append(r.slot)
            r.slot = -1
        r.finish(reason)
