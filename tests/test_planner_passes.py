"""The planner's eager element-wise pass counts (planner/constants.py EAGER_*, EAGER_BACKWARD_FACTOR) against the
bytes every aten op of bunsan's block reads and writes, counted by a dispatch mode on the CPU: so that a change to
the block's code that moves more (or less) memory than the cost model prices fails here.

Counted: every op's tensor inputs and outputs, but the GEMMs, the attention kernel and the ops that move no data
(views, transposes, empty allocations). bf16, one block, fresh gradients (as after zero_grad(set_to_none))."""

from __future__ import annotations

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from bunsan.models.llama import Llama, rope_tables
from bunsan.models.presets import build_config
from bunsan.planner import constants as K

GEMMS = {"mm", "addmm", "bmm", "baddbmm"}
MOVES_NOTHING = {"view", "_unsafe_view", "t", "transpose", "permute", "expand", "detach", "alias", "slice", "select",
                 "unsqueeze", "squeeze", "as_strided", "split", "split_with_sizes", "unbind", "empty", "empty_like",
                 "new_empty", "new_empty_strided", "empty_strided", "lift_fresh", "_reshape_alias", "reshape"}


class ElementwiseBytes(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.bytes, self.ops = 0, collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.__name__.split(".")[0]
        if name in MOVES_NOTHING or name in GEMMS or "attention" in name:
            return out
        tensors = [t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)]
        self.bytes += sum(t.numel() * t.element_size() for t in tensors)
        self.ops[name] += 1
        return out


def counted(preset: str, seq: int) -> tuple[int, int, float]:
    """(forward bytes, backward bytes, the EAGER_* forward bytes) of one block over `seq` tokens."""
    cfg = build_config(preset, num_hidden_layers=1, vocab_size=256)
    torch.manual_seed(0)
    block = Llama(cfg).to(torch.bfloat16).layers[0]
    x = torch.randn(1, seq, cfg.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    cos, sin = (t[:seq].to(torch.bfloat16) for t in rope_tables(cfg))
    with torch.no_grad():
        block(x, cos, sin)              # (lazy set-up out of the count)
    forward, backward = ElementwiseBytes(), ElementwiseBytes()
    with forward:
        y = block(x, cos, sin)
    with backward:
        y.backward(torch.ones_like(y))
    heads, kv, d, h = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
    priced = (K.EAGER_HIDDEN_PASSES * seq * h + K.EAGER_ROPE_PASSES * seq * (heads + kv) * d
              + K.EAGER_MLP_ACT_PASSES * seq * cfg.intermediate_size) * 2
    return forward.bytes, backward.bytes, priced


@pytest.mark.parametrize("preset", ["1b", "7b"])       # GQA 32/8 and MHA
def test_the_eager_block_moves_the_bytes_the_planner_prices(preset):
    fwd, bwd, priced = counted(preset, 128)
    assert fwd == pytest.approx(priced, rel=0.02), f"forward {fwd} bytes, EAGER_* price {priced:.0f}"
    assert bwd / fwd == pytest.approx(K.EAGER_BACKWARD_FACTOR, rel=0.05), \
        f"backward moves {bwd / fwd:.3f}x the forward's element-wise bytes, priced {K.EAGER_BACKWARD_FACTOR}x"
