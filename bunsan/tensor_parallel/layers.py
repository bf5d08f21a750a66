"""Tensor-parallel layers that replace a plain model's nn.Linear / nn.Embedding in place.

Column split (q/k/v, gate/up, LM head): each rank holds a block of output rows.

    W [out, in]  ->  rank r: W[r*out/tp:(r+1)*out/tp, :]     y_r = x W_r^T   (a slice of y, no communication)

Row split (o_proj, down_proj): each rank holds a block of input columns and the
matching slice of the activations; the partial products are summed (g, or the
sequence reduce-scatter under sequence parallelism).

    W [out, in]  ->  rank r: W[:, r*in/tp:(r+1)*in/tp]       y = sum_r x_r W_r^T

A bias goes with its layer: a column layer's is split by rows with them (Qwen2's q/k/v); a row layer's is
whole on every rank and added once, after the sum. Every layer here says which of its parameters are split
and how in `tp_split` (name -> (full shape, split dim)); any other parameter is the same on every rank.

A fused projection ([q; k; v] rows in one linear, Qwen2-VL's vision attention) splits each of its `sections`
by rows: rank r holds rows r of q, of k and of v, side by side (`tp_sections`), so its output is its heads'
q, k and v in the fused layout the attention unpacks.

Vocabulary-parallel embedding: rank r holds rows [r*V/tp, (r+1)*V/tp) of the
table (padded to a multiple of tp); tokens outside its range look up zeros and the
ranks' results are summed.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
import torch.nn.functional as F

from bunsan.tensor_parallel.ops import (GatherLast, RegionLinear, SplitLast, SplitSeq, TPContext, into_parallel_region, out_of_parallel_region, region_of, sum_over_tp)


def split_rows(w: torch.Tensor, tp: int, rank: int, pad_to: int | None = None) -> torch.Tensor:
    rows = w.shape[0] if pad_to is None else pad_to
    if pad_to is not None and pad_to > w.shape[0]:
        w = torch.cat([w, w.new_zeros(pad_to - w.shape[0], *w.shape[1:])])
    n = rows // tp
    return w[rank * n:(rank + 1) * n].clone()


def split_sections(w: torch.Tensor, tp: int, rank: int, sections: int) -> torch.Tensor:
    """Rank `rank`'s rows of each of `sections` equal blocks of rows of w, the blocks' parts side by side."""
    if sections == 1:
        return split_rows(w, tp, rank)
    blocks = w.reshape(sections, w.shape[0] // sections, *w.shape[1:])
    n = blocks.shape[1] // tp
    return blocks[:, rank * n:(rank + 1) * n].reshape(-1, *w.shape[1:]).clone()


def region_linear(x: torch.Tensor, weight: nn.Parameter) -> torch.Tensor:
    """x W^T; a trained weight on a parallel input reduces its input gradient through the region, overlapped
    with its weight gradient (ops.py)."""
    region = region_of(x)
    if region is not None and weight.requires_grad:
        region.consumers += 1
        return RegionLinear.apply(x, weight, region)
    return F.linear(x, weight)


def check_splittable(linear: nn.Module, style: str) -> None:
    """A swapped layer keeps weight and bias: anything else it holds would be dropped."""
    if type(linear) is not nn.Linear:
        raise ValueError(f"tensor-parallel style {style!r} splits an nn.Linear; got {type(linear).__name__}, whose "
                         "forward the split layer would not reproduce (GPT-2's Conv1D stores the weight "
                         "transposed): leave it out of the plan, or convert it to nn.Linear first")
    extra = sorted(set(linear._parameters) - {"weight", "bias"}) + sorted(linear._buffers)
    if extra:
        raise ValueError(f"{type(linear).__name__} holds {extra}, which the {style} split would drop")


class ColumnParallelLinear(nn.Module):
    """A block of output rows (and of the bias); its input must already be in the parallel region (the
    plan's parallel_input), else its input gradient would miss the other ranks' parts."""

    def __init__(self, linear: nn.Linear, ctx: TPContext, check_input: bool = True, gather_output: bool = False,
                 sections: int = 1):
        super().__init__()
        check_splittable(linear, "column")
        if gather_output and sections > 1:
            raise ValueError("a fused projection's output is split by sections; it cannot also be gathered")
        self.ctx, self.gather_output = ctx, gather_output    # gather_output: every rank gets the whole output
        self.tp_style, self.tp_dim, self.full_shape = "column", 0, tuple(linear.weight.shape)
        self.tp_split = {"weight": (self.full_shape, 0)}
        self.tp_sections = sections         # a fused projection: each rank's rows of every section (module doc)
        self.check_input = check_input
        w = linear.weight.detach()
        self.weight = nn.Parameter(split_sections(w, ctx.size, ctx.rank, sections),
                                   requires_grad=linear.weight.requires_grad)
        self.bias = None
        if linear.bias is not None:
            self.bias = nn.Parameter(split_sections(linear.bias.detach(), ctx.size, ctx.rank, sections),
                                     requires_grad=linear.bias.requires_grad)
            self.tp_split["bias"] = (tuple(linear.bias.shape), 0)

    def forward(self, x):
        if self.check_input and x.requires_grad and torch.is_grad_enabled() and region_of(x) is None:
            raise RuntimeError("a column-parallel layer's input never entered the parallel region: its input "
                               "gradient would be this rank's part only; mark the module that receives the "
                               "block's input (the attention or MLP) 'parallel_input' in the plan")
        y = region_linear(x, self.weight)
        y = y if self.bias is None else y + self.bias
        return GatherLast.apply(self.ctx, y) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """A block of input columns; the partial outputs are summed over the tensor-parallel group, then the
    (whole) bias is added once."""

    def __init__(self, linear: nn.Linear, ctx: TPContext, split_input: bool = False):
        super().__init__()
        check_splittable(linear, "row")
        self.split_input = split_input      # its input comes whole: each rank takes its columns first
        self.ctx, self.tp_style, self.tp_dim, self.full_shape = ctx, "row", 1, tuple(linear.weight.shape)
        self.tp_split = {"weight": (self.full_shape, 1)}
        w = linear.weight.detach()
        self.weight = nn.Parameter(split_rows(w.t(), ctx.size, ctx.rank).t().contiguous(),
                                   requires_grad=linear.weight.requires_grad)
        self.bias = None
        if linear.bias is not None:
            self.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=linear.bias.requires_grad)
            if ctx.sequence_parallel:     # each rank adds it to its slice of the sequence only
                sum_grad_over_tp(self.bias, ctx)

    def forward(self, x):
        if self.split_input:
            x = SplitLast.apply(self.ctx, x)
        y = out_of_parallel_region(self.ctx, F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Rows of the table by vocabulary. Under sequence parallelism its output is this rank's slice of the
    sequence, unless `whole_output` (a model that reads the embedding's length: the sequence is cut later)."""

    def __init__(self, emb: nn.Embedding, ctx: TPContext, whole_output: bool = False):
        super().__init__()
        self.ctx, self.tp_style, self.tp_dim = ctx, "vocab", 0
        self.whole_output = whole_output
        self.vocab_size = emb.num_embeddings
        self.padded = -(-self.vocab_size // ctx.size) * ctx.size
        self.full_shape = (self.vocab_size, emb.embedding_dim)
        self.per_rank = self.padded // ctx.size
        self.start = ctx.rank * self.per_rank
        self.tp_split = {"weight": (self.full_shape, 0)}
        if type(emb) is not nn.Embedding or emb.max_norm is not None or emb.scale_grad_by_freq or emb.sparse:
            raise ValueError(f"vocab_embedding splits a plain nn.Embedding; {type(emb).__name__} (or its max_norm / "
                             "scale_grad_by_freq / sparse) would not be reproduced: leave it out of the plan")
        pad = emb.padding_idx   # its row gets no gradient: kept on the rank that holds it
        self.local_padding_idx = pad - self.start if pad is not None and 0 <= pad - self.start < self.per_rank \
            else None
        self.weight = nn.Parameter(split_rows(emb.weight.detach(), ctx.size, ctx.rank, self.padded),
                                   requires_grad=emb.weight.requires_grad)

    def forward(self, ids):
        local = ids - self.start
        outside = (local < 0) | (local >= self.per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight, padding_idx=self.local_padding_idx)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return sum_over_tp(self.ctx, out) if self.whole_output else out_of_parallel_region(self.ctx, out)


class VocabParallelHead(nn.Module):
    """LM head split over the vocabulary: each rank computes its [b, s, V/tp] slice of the logits.

    With `gather_output` every rank gets the whole logits (all-gathered, differentiably: generation, a user's
    loss); the vocabulary-parallel loss (loss.py) works on the slices, within `slices()`.
    """

    def __init__(self, head: nn.Linear, ctx: TPContext, tied: VocabParallelEmbedding | None = None):
        super().__init__()
        self.ctx, self.tp_style, self.tp_dim = ctx, "vocab", 0
        self.vocab_size = head.out_features
        self.padded = -(-self.vocab_size // ctx.size) * ctx.size
        self.full_shape = (self.vocab_size, head.in_features)
        self.start = ctx.rank * (self.padded // ctx.size)
        self.tp_split = {"weight": (self.full_shape, 0)}
        self.gather_output = False
        if type(head) is not nn.Linear or head.bias is not None:
            raise ValueError(f"vocab_head splits an nn.Linear without bias; {type(head).__name__}"
                             + (" has a bias" if getattr(head, "bias", None) is not None else "")
                             + ", which the vocabulary-parallel loss does not carry: leave it out of the plan")
        if tied is not None:
            self.weight = tied.weight       # the same Parameter: tied stays tied
        else:
            self.weight = nn.Parameter(split_rows(head.weight.detach(), ctx.size, ctx.rank, self.padded),
                                       requires_grad=head.weight.requires_grad)

    def forward(self, x):
        logits = region_linear(into_parallel_region(self.ctx, x), self.weight)
        if not self.gather_output:
            return logits
        # whole logits on every rank, differentiably (backward: this rank's slice of the gradient), the
        # padding of the table cut off
        return GatherLast.apply(self.ctx, logits)[..., :self.vocab_size]

    @contextlib.contextmanager
    def slices(self):
        """Within: the forward returns this rank's vocabulary slice, for the vocabulary-parallel loss."""
        gather, self.gather_output = self.gather_output, False
        try:
            yield
        finally:
            self.gather_output = gather


def parallel_input_hook(ctx: TPContext):
    """A block's input enters the parallel region once (f, or the SP all-gather), shared by all its matmuls."""
    def hook(module, args, kwargs):
        if args:
            return (into_parallel_region(ctx, args[0]), *args[1:]), kwargs
        if "hidden_states" in kwargs:       # Hugging Face modules are called by keyword
            return args, {**kwargs, "hidden_states": into_parallel_region(ctx, kwargs["hidden_states"])}
        raise ValueError(f"parallel_input: {type(module).__name__} was called without a positional input or a "
                         f"hidden_states keyword (got {sorted(kwargs)}); its input cannot enter the parallel region")
    return hook


def split_sequence_hook(ctx: TPContext):
    """A module's (whole-sequence) input becomes this rank's slice of the sequence: where a Hugging Face
    decoder's sequence-parallel region starts, at its first layer (its mask and positions are whole)."""
    def hook(module, args, kwargs):
        if args:
            return (SplitSeq.apply(ctx, args[0]), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": SplitSeq.apply(ctx, kwargs["hidden_states"])}
    return hook


def sum_grad_over_tp(param: nn.Parameter, ctx: TPContext) -> None:
    """A replicated weight that each rank sees only part of the data for (SP norms): sum its gradient."""
    if not param.requires_grad:      # frozen (a LoRA base): no gradient to sum
        return

    def hook(grad):
        grad = grad.contiguous().clone()
        ctx.comm.all_reduce(grad, ctx.group)
        return grad
    param.register_hook(hook)
