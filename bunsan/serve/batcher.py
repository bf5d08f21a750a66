"""Continuous batching over the paged KV cache (paged.py, blocks.py): the model side of `bunsan serve`.

Every loop runs one forward over every running sequence and the prompts being prefilled, their tokens
flattened into one row (vLLM's mixed batches):
- decode: each running sequence feeds its last token; one that starts a new block takes one from the pool.
  When the pool has none, the most recently admitted sequence (running, or still being prefilled) is
  preempted: its blocks go back and it waits at the head of the queue to be prefilled again from its prompt
  and the tokens it has produced (vLLM's recompute preemption), so a full cache delays requests and never
  refuses them.
- prefill: the prompts still being prefilled continue, then waiting requests are admitted while there are
  sequence places (`slots`) and blocks for their next chunk. A prompt's whole blocks already in the prefix
  cache are taken, not computed; the rest goes in chunks, at most `prefill_tokens` prompt tokens per forward,
  so a long prompt never stalls the running sequences for more than one chunk.
A request leaves when it ends (length, end of sequence, cancelled: a cancelled one before the next step); its
blocks go back to the pool, the whole ones still cached for a later prompt sharing them.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import Future

import torch

from bunsan.serve.blocks import BlockPool
from bunsan.serve.embeddings import HiddenQueue
from bunsan.serve.media import overlay
from bunsan.serve.paged import PagedCache
from bunsan.serve.prefix import common_prefix
from bunsan.serve.sampling import END, Token, draw_rows, prompt_logprobs
from bunsan.serve.sequence import Request, Sequence, check_embeddable, check_fits
from bunsan.serve.tp import HEARTBEAT_S

BLOCK_SIZE = 16


class Batcher:
    """Runs requests on `model` with at most `slots` sequences at once; `submit` from any thread, `run` on one."""

    def __init__(self, model, slots: int, max_len: int, kv_heads: int | None = None, leader=None,
                 prefix_reuse: bool = True, prefill_tokens: int = 2048, num_blocks: int | None = None,
                 block_size: int = BLOCK_SIZE, adapters=None):
        """`leader` (serve/tp.py): under tensor parallelism, announces every forward to the other ranks.
        `num_blocks`: the KV pool's blocks of `block_size` tokens (default: enough for `slots` sequences of
        `max_len`, plus block 0). `prefill_tokens`: the most prompt tokens (padding included) one prefill
        forward takes. `adapters`: the lora.AdapterSet installed in `model`, when it serves LoRA adapters."""
        self.model, self.max_len, self.leader, self.adapters = model.eval(), max_len, leader, adapters
        self.slots, self.prefix_reuse, self.prefill_tokens = slots, prefix_reuse, max(prefill_tokens, 1)
        self.fatal: str | None = None       # a failure that ends serving (a tensor-parallel rank died)
        self.on_fatal = None                # called once with it (the server shuts down)
        num_blocks = num_blocks or 1 + slots * -(-max_len // block_size)
        self.cache = PagedCache(model, num_blocks, block_size, kv_heads)
        self.pool = BlockPool(num_blocks, block_size)
        self.running: list[Sequence] = []
        self.prefilling: list[Sequence] = []
        self.waiting: deque[Request] = deque()
        self.lock, self.wake = threading.Lock(), threading.Event()
        self.stopped = False
        self.steps = 0
        self.preempted = 0                  # sequences sent back to the queue for want of blocks
        self.admitted = 0
        self.reused_tokens = 0              # prompt tokens not prefilled thanks to the prefix cache
        # where the serving loop's time goes (/metrics): loops run, the seconds they took, and of those the
        # model's forwards; the rest of a loop is scheduling and sampling on this thread
        self.loops, self.busy_s, self.forward_s = 0, 0.0, 0.0
        self.embeds = HiddenQueue()                                 # hidden-state requests (embeddings.py)
        self.after_loop = None              # called on this thread after every loop and at the end (engine.py)

    def submit(self, r: Request) -> None:
        check_fits(len(r.ids), r.max_tokens, self.max_len, self.pool.block_size, self.pool.usable)
        with self.lock:
            self.waiting.append(r)
        self.wake.set()

    def hidden(self, ids: list[int]) -> Future:
        """Every position's final hidden state (the head's input) for `ids`, [len(ids), hidden] fp32 on the CPU,
        computed on the batcher's thread between two steps (the model is never run from two threads)."""
        check_embeddable(len(ids), self.max_len, self.leader is not None)
        done = self.embeds.put(ids)
        self.wake.set()
        return done

    def load(self) -> tuple[int, int]:
        with self.lock:
            return len(self.running) + len(self.prefilling), len(self.waiting)

    def stop(self) -> None:
        self.stopped = True
        self.wake.set()

    def run(self) -> None:
        """The serving loop: one forward (every running sequence's next token, the next prompt chunks) after
        another, until stopped."""
        beat = time.monotonic()
        try:
            while not self.stopped:
                self.embeds.run(self.model)
                if not self.running and not self.prefilling and not self.waiting:
                    if self.after_loop is not None:
                        self.after_loop()
                    self.wake.wait(0.1)
                    self.wake.clear()
                    if self.leader is not None and time.monotonic() - beat > HEARTBEAT_S:   # rank 0 lives
                        beat = time.monotonic()
                        self._guard(self.leader.heartbeat)
                    continue
                start = time.perf_counter()
                self._iterate()
                self.loops += 1
                self.busy_s += time.perf_counter() - start
                if self.after_loop is not None:
                    self.after_loop()
        except Exception as e:          # never die silently: every request still gets its answer below
            self.fatal = self.fatal or f"the batcher failed: {type(e).__name__}: {e}"
            self.stopped = True
        reason = f"error: {self.fatal}" if self.fatal else "error: the server is shutting down"
        with self.lock:
            left = [s.request for s in self.running + self.prefilling] + list(self.waiting)
            self.running, self.prefilling = [], []
            self.waiting.clear()
        for r in left:
            r.finish(reason)
        self.embeds.fail(RuntimeError(reason.removeprefix("error: ")))
        if self.after_loop is not None:
            self.after_loop()
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

    def _forward(self, rows: list[Sequence], counts: list[int], ids: list[int], keep: list[int]) -> torch.Tensor:
        """Logits [len(keep), vocab] at the tokens `keep` (ascending) of the rows' `counts` new tokens `ids` (row
        after row). The model's head computes only those, but under tensor parallelism (every rank runs the
        same forward)."""
        width = max(len(s.blocks) for s in rows)
        tables = torch.tensor([s.blocks + [BlockPool.TRASH] * (width - len(s.blocks)) for s in rows])
        lengths, counts = torch.tensor([s.cached for s in rows]), torch.tensor(counts)
        ids = torch.tensor([ids]).to(self.cache.device)   # where the model starts (a device map moves it on)
        if self.leader is not None:
            self._guard(self.leader.forward, tables, lengths, counts, ids)
        if self.adapters is not None:        # each token's LoRA adapter (lora.py)
            self.adapters.rows = torch.repeat_interleave(torch.tensor([s.request.adapter for s in rows]), counts)
        try:
            with torch.no_grad():
                view = self.cache.view(tables, lengths, counts)
                keep = torch.tensor(keep)
                view.keep = keep if self.leader is None and len(keep) < len(ids[0]) else None
                if any(s.request.media is not None for s in rows):     # image tokens' embeddings (media.py)
                    view.media = overlay([(s.request.media, s.cached, c) for s, c in zip(rows, counts.tolist())],
                                         view.at[0])
                start = time.perf_counter()
                logits = self._guard(lambda: self.model(ids, kv_cache=view))[0]
                self.forward_s += time.perf_counter() - start
                return logits if view.keep is not None or len(keep) == len(logits) else logits[keep.to(logits.device)]
        finally:
            if self.adapters is not None:
                self.adapters.rows = None

    # -- blocks --------------------------------------------------------------------------------------------
    def _grow(self, s: Sequence, upto: int) -> bool:
        """Blocks for `s`'s first `upto` tokens; False (nothing taken) when the pool has too few free."""
        need = -(-upto // self.pool.block_size) - len(s.blocks)
        if need > self.pool.available():
            return False
        s.blocks += [self.pool.allocate() for _ in range(need)]
        return True

    def _register(self, s: Sequence) -> None:
        """Put `s`'s newly filled whole blocks in the prefix cache."""
        bs = self.pool.block_size
        while self.prefix_reuse and (s.registered + 1) * bs <= s.cached:
            i = s.registered
            s.parent = self.pool.register(s.blocks[i], s.parent, s.keys(i * bs, (i + 1) * bs))
            s.registered += 1

    def _preempt(self, s: Sequence) -> None:
        """`s` gives its blocks back and waits first in line, to be prefilled again from everything it holds
        (its prompt and the tokens it produced)."""
        if s in self.running:
            self.running.remove(s)
            s.tokens.append(s.request.last)         # its last token was not fed yet: the prefill feeds it
        else:
            self.prefilling.remove(s)
        self.pool.release(s.blocks)
        s.blocks, s.cached, s.registered, s.parent = [], 0, 0, s.request.root
        s.resumed = s.resumed or bool(s.request.generated)
        s.prompt_logits = []
        self.preempted += 1
        with self.lock:
            self.waiting.appendleft(s.request)

    # -- prefill --------------------------------------------------------------------------------------------
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
            self._end(r, "cancelled")

    def _admit(self, r: Request, beside: list[Sequence]) -> Sequence | None:
        """`r`'s sequence holding the whole blocks of its prefix already cached; None when it should wait a step
        for a prompt prefilled `beside` it that will put more of its prefix in the cache."""
        s = r.seq or Sequence(r, list(r.ids), 0, parent=r.root)
        if self.prefix_reuse and (r.prompt_logprobs is None or s.resumed):   # echo needs every position
            keys = s.keys()
            s.blocks, s.parent = self.pool.cached_prefix(keys, len(keys) - 1, r.root)
            s.registered = len(s.blocks)
            s.cached = s.registered * self.pool.block_size
            pending = max((common_prefix(keys, o.keys()) for o in beside), default=0)
            if pending >= s.cached + self.pool.block_size:
                self._release(s)
                return None
        return s

    def _encoded(self, r: Request) -> bool:
        """`r`'s images are encoded (once for a prompt's sequences); False when that failed (`r` has ended)."""
        media = r.media
        if media is not None and media.encoded is None and media.failed is None:
            try:
                media.encoded = self.model.encode(r.ids, media.inputs)
            except Exception as e:        # this prompt's failure is its own
                media.failed = f"error: encoding the images failed: {type(e).__name__}: {e}"
            media.inputs = {}
        if media is not None and media.failed is not None:
            with self.lock:
                self.waiting.popleft()
            self._end(r, media.failed)
            return False
        return True

    def _release(self, s: Sequence) -> None:
        """An admission that did not go ahead gives back the cached blocks it took."""
        self.pool.release(s.blocks)
        s.blocks, s.cached, s.registered, s.parent = [], 0, 0, s.request.root

    def _plan_prefill(self) -> list[tuple[Sequence, int]]:
        """(sequence, tokens of it to prefill now): the ones under way first, then waiting ones admitted, within
        `prefill_tokens` tokens in all."""
        for s in [s for s in self.prefilling if s.request.cancelled]:
            self._end(s.request, "cancelled")
        batch, used = [], 0
        for s in list(self.prefilling):
            count = self._chunk(s, used)
            if count:
                batch.append((s, count))
                used += count
        while len(self.running) + len(self.prefilling) < self.slots:
            r = self._next_waiting()
            if r is None:
                break
            if not self._encoded(r):
                continue
            s = self._admit(r, [b for b, _ in batch])
            count = 0 if s is None else self._chunk(s, used)
            if not count:
                if s is not None:
                    self._release(s)
                break
            with self.lock:
                self.waiting.popleft()
            self.admitted += 1
            s.admitted, r.seq = self.admitted, s
            self.reused_tokens += s.cached
            self.prefilling.append(s)
            batch.append((s, count))
            used += count
        if not batch and not self.running and self.prefilling:
            # prompts under way hold the blocks the others need, and nothing runs to free some: the latest waits
            self._preempt(max(self.prefilling, key=lambda q: q.admitted))
        return batch

    def _chunk(self, s: Sequence, used: int) -> int:
        """How many of `s`'s remaining tokens join this forward beside `used` prompt tokens: all that fit the
        token budget; 0 when none do or the pool has no block for them."""
        count = min(len(s.tokens) - s.cached, self.prefill_tokens - used)
        if count <= 0 or not self._grow(s, s.cached + count):
            return 0
        return count

    # -- one forward ----------------------------------------------------------------------------------------
    def _iterate(self) -> None:
        for s in [s for s in self.running if s.request.cancelled]:     # blocks freed before the forward
            self._end(s.request, "cancelled")
        for s in sorted(self.running, key=lambda q: q.admitted):
            while s in self.running and not self._grow(s, s.cached + 1):
                # the latest admitted gives way, a prompt still being prefilled included; possibly `s` itself
                self._preempt(max(self.running + self.prefilling, key=lambda q: q.admitted))
        decoding = list(self.running)
        chunks = self._plan_prefill()
        rows = decoding + [s for s, _ in chunks]
        if not rows:
            return
        counts = [1] * len(decoding) + [count for _, count in chunks]
        ids = [s.request.last for s in decoding]
        for s, count in chunks:
            ids += s.tokens[s.cached:s.cached + count]
        # the tokens whose logits are read: each row's last, and every prompt token of a prompt echoed with its
        # log-probabilities (`spans`: where those are among them); the head computes only these
        keep, lasts, spans, end = [], [], {}, -1
        for j, (s, count) in enumerate(zip(rows, counts)):
            end += count
            if j >= len(decoding) and s.request.prompt_logprobs is not None and not s.resumed:
                spans[j] = (len(keep), len(keep) + count)
                keep += range(end - count + 1, end + 1)
            else:
                keep.append(end)
            lasts.append(len(keep) - 1)
        try:
            logits = self._forward(rows, counts, ids, keep)
        except Exception as e:            # these requests fail; the server goes on
            for s in rows:
                self._end(s.request, f"error: {type(e).__name__}: {e}")
            return
        last = logits[lasts].float().cpu()                # each row's last token's next-token logits
        if decoding:
            self.steps += 1
        drawn = draw_rows([s.request for s in decoding], last[:len(decoding)])
        for s, token in zip(decoding, drawn):
            s.tokens.append(s.request.last)     # its keys and values are in its blocks now
            s.cached += 1
            self._register(s)
            try:
                if isinstance(token, Exception):
                    raise token
                self._emit(s.request, token)
            except Exception as e:        # a bad sample ends this request only
                self._end(s.request, f"error: {type(e).__name__}: {e}")
        for j, (s, count) in enumerate(chunks, start=len(decoding)):
            s.cached += count
            self._register(s)
            if j in spans:
                s.prompt_logits.append(logits[spans[j][0]:spans[j][1]])
            if s.cached == len(s.tokens):
                self.prefilling.remove(s)
                self.running.append(s)
                self._started(s, last[j])

    def _started(self, s: Sequence, last: torch.Tensor) -> None:
        """A sequence's prefill is done: its prompt's log-probabilities (echo), then its next token."""
        r = s.request
        try:
            if not s.resumed:
                if r.on_prompt is not None and r.prompt_logprobs is not None:
                    r.on_prompt(prompt_logprobs(torch.cat(s.prompt_logits), r.ids, r.prompt_logprobs))
                s.prompt_logits = []
                if r.max_tokens == 0:
                    return self._end(r, "length")
            self._emit(r, r.draw(last))
        except Exception as e:            # this request's failure is its own; the others go on
            self._end(r, f"error: {type(e).__name__}: {e}")

    def _emit(self, r: Request, token: Token) -> None:
        if r.cancelled:
            return self._end(r, "cancelled")
        r.generated += 1
        r.last = token.id
        if token.id in r.eos or token.id == END:
            return self._end(r, "eos")
        r.emit(token)
        if token.final:                   # its grammar is complete
            return self._end(r, "eos")
        if r.generated >= r.max_tokens:
            return self._end(r, "length")

    def _end(self, r: Request, reason: str) -> None:
        s = r.seq
        if s is not None:
            for queue in (self.running, self.prefilling):
                if s in queue:
                    queue.remove(s)
            self.pool.release(s.blocks)
            s.blocks = []
            r.seq = None
        r.finish(reason)
