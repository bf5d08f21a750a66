"""Continuous batching over a KV cache of independent slots (slots.py): the model side of `bunsan serve`.

Every loop admits waiting requests into free slots, their prompts prefilled together in one forward (rows
padded to the longest, within `prefill_tokens`), then runs one decode step over every running request. So a
request waits at most one prefill for a slot that frees, and a running one at most one prefill between two
of its tokens. A request leaves its slot when it ends (length, end of sequence, cancelled: a cancelled one
before the next step) and its slot keeps its keys and values for a later prompt that shares their prefix
(prefix.py).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

import torch

from bunsan.models.llama import Llama
from bunsan.serve.prefix import SlotTokens, common_prefix
from bunsan.serve.sampling import RowSampler, SamplingParams, Token, prompt_logprobs
from bunsan.serve.slots import SlotCache
from bunsan.serve.tp import HEARTBEAT_S

SHARED_WAIT = 16      # a prompt sharing this many more tokens with one prefilled beside it waits a step to copy


@dataclass
class Request:
    """One sequence. `emit(Token)` is called for every new token, `finish(reason)` once at the end ("eos",
    "length", "cancelled" or "error: ..."), `on_prompt(tokens)` with the prompt's log-probabilities when
    `prompt_logprobs` asks for them; all from the batcher's thread."""
    ids: list[int]
    max_tokens: int
    emit: callable
    finish: callable
    sampler: RowSampler | None = None          # None: greedy
    eos: frozenset[int] = frozenset()
    prompt_logprobs: int | None = None
    on_prompt: callable = None
    cancelled: bool = False
    generated: int = 0
    last: int = 0
    slot: int = -1

    def draw(self, logits: torch.Tensor) -> Token:
        if self.sampler is None:
            self.sampler = RowSampler(SamplingParams(), self.ids, logits.shape[-1])
        return self.sampler.draw(logits)


class Batcher:
    """Runs requests on `model` with at most `slots` at once; `submit` from any thread, `run` on one."""

    def __init__(self, model: Llama, slots: int, max_len: int, kv_heads: int | None = None, leader=None,
                 prefix_reuse: bool = True, prefill_tokens: int = 2048):
        """`leader` (serve/tp.py): under tensor parallelism, announces every forward to the other ranks.
        `prefill_tokens`: the most prompt tokens (padding included) one prefill forward takes, unless a single
        prompt is longer."""
        self.model, self.max_len, self.leader = model.eval(), max_len, leader
        self.prefix_reuse, self.prefill_tokens = prefix_reuse, prefill_tokens
        self.fatal: str | None = None       # a failure that ends serving (a tensor-parallel rank died)
        self.on_fatal = None                # called once with it (the server shuts down)
        self.cache = SlotCache(model, slots, max_len, kv_heads)
        self.held = SlotTokens(slots)
        self.free = list(range(slots))      # least recently used first: a prompt sharing nothing takes [0]
        self.active: dict[int, Request] = {}
        self.waiting: deque[Request] = deque()
        self.lock, self.wake = threading.Lock(), threading.Event()
        self.stopped = False
        self.steps = 0
        self.reused_tokens = 0              # prompt tokens not prefilled thanks to a cached prefix

    def submit(self, r: Request) -> None:
        if len(r.ids) + r.max_tokens > self.max_len:
            raise ValueError(f"prompt of {len(r.ids)} tokens + max_tokens {r.max_tokens} exceeds the context of "
                             f"{self.max_len} tokens; shorten the prompt or ask for fewer tokens")
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
        with self.lock:
            left = list(self.active.values()) + list(self.waiting)
            self.active.clear()
            self.waiting.clear()
        for r in left:
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

    def _copy(self, src: int, dst: int, n: int) -> None:
        if self.leader is not None:
            self._guard(self.leader.copy, src, dst, n)
        self.cache.copy(src, dst, n)
        self.held.set(dst, self.held.tokens[src][:n])

    def _place(self, r: Request, beside: list[Request]) -> tuple[int, int] | None:
        """(slot, prompt tokens already cached there) for `r`, copying a running slot's prefix when it is the
        longest; None when `r` should wait a step for a prompt prefilled `beside` it that it shares more with."""
        usable = len(r.ids) - 1
        if not self.prefix_reuse or r.prompt_logprobs is not None:     # echo's logprobs need every position
            return self.free[0], 0
        slot, reuse = self.held.best(r.ids, self.free, usable)
        source, shared = self.held.best(r.ids, self.active, usable)
        pending = max((min(usable, common_prefix(r.ids, o.ids)) for o in beside), default=0)
        if pending >= max(reuse, shared) + SHARED_WAIT:
            return None
        if shared > reuse:
            slot, reuse = self.free[0], shared
            self._copy(source, slot, shared)
        return (slot if slot >= 0 else self.free[0]), reuse

    def _next_waiting(self) -> Request | None:
        """The first waiting request that is still wanted (the cancelled ones are answered on the way)."""
        while True:
            with self.lock:
                if not self.waiting:
                    return None
                r = self.waiting[0]
                if not r.cancelled:
                    return r
                self.waiting.popleft()
            r.finish("cancelled")

    def _plan_prefill(self) -> list[tuple[Request, int]]:
        """The waiting requests (in order) to prefill together now, each placed in a slot, with the tokens of
        its prompt already in the slot."""
        batch: list[tuple[Request, int]] = []
        width = 0
        while self.free:
            r = self._next_waiting()
            if r is None:
                break
            placed = self._place(r, [b for b, _ in batch])
            if placed is None:
                break
            slot, reuse = placed
            wider = max(width, len(r.ids) - reuse)
            starts = [s for _, s in batch] + [reuse]
            if batch and (wider * len(starts) > self.prefill_tokens or max(starts) + wider > self.max_len):
                break
            with self.lock:
                self.waiting.popleft()
            self.free.remove(slot)
            r.slot, width = slot, wider
            self.held.keep(slot, reuse)
            self.cache.lengths[slot] = reuse
            self.active[slot] = r             # running from its prefill on (health and limits count it)
            batch.append((r, reuse))
        return batch

    def _admit(self) -> None:
        batch = self._plan_prefill()
        if not batch:
            return
        width = max(len(r.ids) - start for r, start in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)   # padding: positions past a row's prompt
        for j, (r, start) in enumerate(batch):
            ids[j, :len(r.ids) - start] = torch.tensor(r.ids[start:])
        try:
            logits = self._forward([r.slot for r, _ in batch], ids)
        except Exception as e:            # these requests fail; the running ones go on
            for r, _ in batch:
                self._end(r, f"error: {type(e).__name__}: {e}")
            return
        ends = torch.tensor([len(r.ids) - start - 1 for r, start in batch])
        last = logits[torch.arange(len(batch)), ends].float().cpu()
        for j, (r, start) in enumerate(batch):
            self.cache.lengths[r.slot] = len(r.ids)        # the padding's keys are overwritten as it decodes
            self.held.set(r.slot, r.ids)
            self.reused_tokens += start
            self._started(r, logits[j, :len(r.ids) - start], last[j])

    def _started(self, r: Request, prompt_logits: torch.Tensor, last: torch.Tensor) -> None:
        """A request's prefill is done: its prompt's log-probabilities (echo), then its first token."""
        try:
            if r.on_prompt is not None and r.prompt_logprobs is not None:
                r.on_prompt(prompt_logprobs(prompt_logits, r.ids, r.prompt_logprobs))
            if r.max_tokens == 0:
                return self._end(r, "length")
            self._emit(r, r.draw(last))
        except Exception as e:            # this request's failure is its own; the others go on
            self._end(r, f"error: {type(e).__name__}: {e}")

    def _step(self) -> None:
        for r in [r for r in self.active.values() if r.cancelled]:     # a slot freed before the forward
            self._end(r, "cancelled")
        rows = sorted(self.active)
        if not rows:
            return
        ids = torch.tensor([[self.active[s].last] for s in rows])
        try:
            logits = self._forward(rows, ids)[:, -1].float().cpu()
        except Exception as e:
            for s in rows:
                self._end(self.active[s], f"error: {type(e).__name__}: {e}")
            return
        self.steps += 1
        for j, s in enumerate(rows):
            r = self.active[s]
            self.held.append(s, r.last)        # its keys and values are in the slot now
            try:
                self._emit(r, r.draw(logits[j]))
            except Exception as e:        # a bad sample ends this request only
                self._end(r, f"error: {type(e).__name__}: {e}")

    def _emit(self, r: Request, token: Token) -> None:
        if r.cancelled:
            return self._end(r, "cancelled")
        r.generated += 1
        r.last = token.id
        if token.id in r.eos:
            return self._end(r, "eos")
        r.emit(token)
        if r.generated >= r.max_tokens:
            return self._end(r, "length")

    def _end(self, r: Request, reason: str) -> None:
        self.active.pop(r.slot, None)
        if r.slot >= 0:
            self.free.append(r.slot)
            r.slot = -1
        r.finish(reason)
