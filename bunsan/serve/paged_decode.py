"""The decoding rows' attention read from the paged pool in place, on the CPU: vLLM's CPU paged-attention
kernel's job, written as PyTorch ops that torch.compile (inductor) fuses into one C++ loop nest.

A decoding row has one token's queries (rep query heads per key/value head) over a few blocks of its own.
The eager path (paged.py) copies those blocks out of the pool (index_select) and hands them to PyTorch's
fused CPU attention, whose fixed cost per (row, head) outweighs a 2-query, tens-of-keys problem; the kernel
here reads each block where it lies, through the block table, and does the whole batch in one pass:
scores, a masked softmax with its log-sum-exp (what cascade attention joins the shared blocks' part by), and
the weighted values. fp32 throughout, whatever the pool's dtype (as the fused kernel accumulates).

One graph serves every batch: the rows and the blocks per row are dynamic (at least two of each, padded:
PyTorch specialises a size of 1), the heads, head dim and dtype static. Where compiling fails (no C++
compiler) or the compiled result differs from the eager one on a probe, the eager path runs, as it does for
batches whose keys and values fit in the cache (MIN_BYTES).
"""

from __future__ import annotations

import logging
import threading

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)
TOLERANCE = 1e-4          # the probe's agreement with PyTorch's attention (fp32 rounding is ~1e-6)
# Below this many bytes of keys and values a layer, the rows' blocks are copied out for PyTorch's attention
# instead: a copy that stays in the cache costs less than this kernel, which is slower per key than PyTorch's
# fused one and pays torch.compile's call overhead (bench_serve's model: 1-8 decoding rows, and up to 32 rows of
# ~20 own keys, ran 3-13% slower in place; 32 and 64 rows of ~150 own keys 24% faster; benchmarks/RESULTS.md).
MIN_BYTES = 4 << 20


def own_blocks_attention(q: torch.Tensor, pool_k: torch.Tensor, pool_v: torch.Tensor, slots: torch.Tensor,
                         bias: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q [n, kv, rep, hd] over the keys at `slots` [n, keys] (block * block_size + offset) of the pools [pool
    blocks, bs, kv, hd], each key's `bias` [n, keys] added to its score (0 seen, -inf hidden; a row sees at
    least one key): (out [n, kv, rep, hd], log-sum-exp [n, kv, rep]), fp32."""
    n, width = slots.shape
    kv, hd = pool_k.shape[2:]
    keys = pool_k.view(-1, kv, hd)[slots].view(n, width, kv, 1, hd).float()
    scores = (keys * q[:, None]).sum(-1) * scale + bias[:, :, None, None]         # [n, keys, kv, rep]
    top = scores.amax(1, keepdim=True)
    weights = torch.exp(scores - top)
    total = weights.sum(1, keepdim=True)
    values = pool_v.view(-1, kv, hd)[slots].view(n, width, kv, 1, hd).float()
    out = (weights[..., None] * values).sum(1) / total[:, 0, ..., None]
    return out, (top + torch.log(total))[:, 0]


class _Compiled:
    """own_blocks_attention compiled once per process, checked on a probe before its first use per shape."""

    def __init__(self):
        self.fn = None
        self.checked: dict[tuple, bool] = {}      # (dtype, block size, kv, rep, hd) -> the probe agreed
        self.failed = False                       # a call raised: never again
        self.lock = threading.Lock()

    def usable(self, q: torch.Tensor, pool_k: torch.Tensor) -> bool:
        if self.failed:
            return False
        key = (pool_k.dtype, *pool_k.shape[1:3], q.shape[2], pool_k.shape[3])
        if key not in self.checked:
            with self.lock:
                if key not in self.checked:
                    self.checked[key] = self._probe(*key)
        return self.checked[key]

    def _probe(self, dtype: torch.dtype, bs: int, kv: int, rep: int, hd: int) -> bool:
        """Compile (the first time; the graph the serving calls then reuse) and compare with PyTorch's
        attention on random rows."""
        try:
            if self.fn is None:
                self.fn = torch.compile(own_blocks_attention, dynamic=False)
            g = torch.Generator().manual_seed(0)
            pool_k, pool_v = (torch.randn(9, bs, kv, hd, generator=g).to(dtype) for _ in range(2))
            q = torch.randn(3, kv, rep, hd, generator=g)
            table = torch.tensor([[1, 2, 0], [3, 4, 5], [6, 7, 8]])
            seen = torch.arange(3 * bs)[None] <= torch.tensor([bs + 1, 3 * bs - 1, 0])[:, None]
            bias = torch.zeros(seen.shape).masked_fill(~seen, float("-inf"))
            got, lse = self(q, pool_k, pool_v, table, bias, hd ** -0.5)
            # the same by matmuls: query head h of kv head h // rep, its keys repeated per query head
            keys, values = (pool[table].reshape(3, 3 * bs, kv, hd).transpose(1, 2).float()
                            .repeat_interleave(rep, 1) for pool in (pool_k, pool_v))
            scores = torch.matmul(q.reshape(3, kv * rep, 1, hd), keys.transpose(-1, -2)) * hd ** -0.5 + \
                bias[:, None, None]
            want = torch.matmul(torch.softmax(scores, -1), values).view(3, kv, rep, hd)
            want_lse = scores.logsumexp(-1).view(3, kv, rep)
            if torch.allclose(got, want, atol=TOLERANCE, rtol=TOLERANCE) and \
                    torch.allclose(lse, want_lse, atol=TOLERANCE, rtol=TOLERANCE):
                return True
            log.warning("the compiled paged decode attention differs from PyTorch's on a probe; decoding reads "
                        "the blocks through copies instead")
        except Exception as e:      # no C++ compiler, an inductor without this op: the eager path serves
            log.warning("paged decode attention not compiled (%s: %s); decoding reads the blocks through copies",
                        type(e).__name__, str(e).splitlines()[0] if str(e) else "")
        return False

    def __call__(self, q, pool_k, pool_v, table, bias, scale):
        """own_blocks_attention compiled, over the blocks of `table` [n, blocks] (bias [n, blocks * bs]); None
        where the call failed."""
        n, width = table.shape
        rows, blocks = max(n, 2), max(width, 2)       # pad: one graph for every batch (a size-1 dim specialises)
        if (rows, blocks) != (n, width):
            table = F.pad(table, (0, blocks - width, 0, rows - n))     # block 0, hidden by the bias below
            bias = F.pad(bias, (0, (blocks - width) * pool_k.shape[1], 0, rows - n), value=float("-inf"))
            bias[n:, 0] = 0.0                                          # a padded row sees one key: no NaN
            q = F.pad(q, (0, 0, 0, 0, 0, 0, 0, rows - n))
        bs = pool_k.shape[1]
        slots = (table[:, :, None] * bs + torch.arange(bs, device=table.device)).view(rows, -1)
        for t in (q, slots, bias, pool_k, pool_v):      # (the pool's blocks too: every pool size, one graph)
            torch._dynamo.maybe_mark_dynamic(t, 0)
        torch._dynamo.maybe_mark_dynamic(slots, 1)
        torch._dynamo.maybe_mark_dynamic(bias, 1)
        try:
            with torch.no_grad():                     # (one grad mode: a graph is compiled per mode)
                out, lse = self.fn(q.contiguous(), pool_k, pool_v, slots, bias, float(scale))
        except Exception as e:     # a shape or build the probe did not meet: copies from now on, said once
            log.warning("the compiled paged decode attention failed (%s: %s); decoding reads the blocks through "
                        "copies from now on", type(e).__name__, str(e).splitlines()[0] if str(e) else "")
            self.failed = True
            return None
        return out[:n], lse[:n]


COMPILED = _Compiled()


def in_place(q: torch.Tensor, pool_k: torch.Tensor, table: torch.Tensor | None = None) -> bool:
    """Whether decoding over `pool_k` reads it in place: a CPU pool, the compiled kernel agreeing with PyTorch's
    attention, and (given the rows' block `table`) their keys and values past MIN_BYTES a layer."""
    if table is not None and table.numel() * pool_k[0].numel() * pool_k.element_size() * 2 < MIN_BYTES:
        return False
    return pool_k.device.type == "cpu" and q.device.type == "cpu" and COMPILED.usable(q, pool_k)

