"""Seconds per optimizer step for a layout: an analytic model the planner ranks layouts with.

    total = compute + recompute + tp_comm + dp_comm (exposed) + pp_comm + bubble + offload + cp_comm

Compute follows the PaLM/Megatron convention: 6N + 12·L·h·s FLOPs per token (N without
the input embedding table, which is a lookup), spread evenly over the GPUs and run at
`efficiency` x the chip's dense peak. Communication uses ring volumes (all-reduce
2(n-1)/n·S, all-gather and reduce-scatter (n-1)/n·S) over the link each group uses.
Data-parallel traffic follows what bunsan's ZeRO does per micro-step (bunsan/zero/):

    stage 0   all-reduce of gradients on the last micro-step, during its backward
    stage 1   reduce-scatter on the last micro-step (overlapped), parameter all-gather after the step
    stage 2   reduce-scatter on every micro-step (overlapped), parameter all-gather after the step
    stage 3   per micro-step: gather in forward, re-gather in backward, reduce-scatter (all overlapped)

Under pipeline stages every stage reduces once after the schedule, exposed (nothing computes then); ZeRO-3
gathers per micro-batch in forward and backward (overlapped), or once before the schedule (exposed) with
stage3_pipeline_gather "schedule".

With one micro-step this is the textbook 2Ψ for stages 0-2 and 3Ψ for stage 3. Context-parallel ranks
are data parallel for gradients (ZeRO over dp x cp) and, per layer and micro-batch, all-gather K and V in
forward ((cp-1)/cp of the whole row's K/V bytes; again when a recomputed forward reruns it) and
reduce-scatter their gradients in backward (the same bytes); never overlapped.
Every figure is an estimate; `benchmarks/` measures the real thing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from bunsan.config.optimizer_sections import OPTIMIZERS
from bunsan.memory.theory import optimizer_state_bytes_per_param
from bunsan.models.llama import LlamaConfig
from bunsan.pipeline.schedules import theory_bubble
from bunsan.tensor_parallel.plan import check_llama
from bunsan.estimator import hardware
from bunsan.estimator.hardware import GPU, Interconnect
from bunsan.estimator.activations import Micro
from bunsan.estimator.layout import Layout
from bunsan.estimator.recompute import offloaded_count, offloaded_per_block

# Fraction of dense peak a well-tuned training step sustains. Megatron-LM and PaLM report
# 40-55% MFU on A100/H100 at scale; 0.4 is a conservative estimate, not a measurement.
EFFICIENCY = 0.4
# Fraction of the compute window that really hides overlapped data-parallel traffic. An
# estimate: NCCL kernels share SMs and memory bandwidth with the matmuls they overlap.
OVERLAP = 0.8
# Full activation checkpointing reruns each block's forward in backward; with backward
# costing about twice the forward, that is 1/3 of forward + backward (Megatron-LM).
RECOMPUTE_FRACTION = 1 / 3
FORWARD_FRACTION = 1 / 3   # forward share of forward + backward; backward is the other 2/3
# fp32 optimizer-state bytes per parameter besides the 4-byte master copy (as memory/theory.py's K;
# 8-bit AdamW keeps two 1-byte moments; Adafactor's factored moments are negligible).
MASTER_BYTES = 4
GRAD_SHARD_BYTES = 4   # bunsan keeps the reduced gradient shard in fp32 (zero/optimizer.py)
# Host-side figures (estimates; see hardware.py).
HOST_LINK_BYTES_PER_S = hardware.HOST_LINK_BYTES_PER_S
NVME_READ_BYTES_PER_S = hardware.NVME_READ_BYTES_PER_S
NVME_WRITE_BYTES_PER_S = hardware.NVME_WRITE_BYTES_PER_S
CPU_ADAM_PARAMS_PER_S = hardware.CPU_ADAM_PARAMS_PER_S

COMPONENTS = ("compute", "recompute", "tp_comm", "dp_comm", "pp_comm", "bubble", "offload", "cp_comm")


@dataclass(frozen=True)
class StepTime:
    """Seconds per optimizer step, by component; `total` is their sum."""

    compute: float
    recompute: float
    tp_comm: float
    dp_comm: float           # exposed: the part overlap with compute does not hide
    pp_comm: float
    bubble: float
    offload: float
    dp_comm_total: float     # all data-parallel traffic, before overlap
    tokens_per_step: int
    flops_per_token: float   # 6N + 12·L·h·s
    gpus: int
    peak_flops: float        # per GPU, dense, for the layout's precision
    assumptions: tuple = ()
    cp_comm: float = 0.0     # context parallel: the K/V all-gathers and their gradients' reduce-scatters

    @property
    def total(self) -> float:
        return sum(getattr(self, name) for name in COMPONENTS)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.total

    @property
    def mfu(self) -> float:
        """Model FLOPs utilisation: useful FLOP/s over the GPUs' dense peak (recompute is not useful work)."""
        return self.flops_per_token * self.tokens_per_s / (self.gpus * self.peak_flops)

    def explain(self) -> str:
        total = self.total
        lines = [f"step {total:.4g} s: {self.tokens_per_s:,.0f} tokens/s, MFU {self.mfu:.1%}"]
        for name in COMPONENTS:
            seconds = getattr(self, name)
            lines.append(f"  {name:<10} {seconds:10.4g} s  {seconds / total:6.1%}")
        lines.append(f"  (data-parallel traffic {self.dp_comm_total:.4g} s before overlap)")
        lines.append("assumptions:")
        lines += [f"  - {text}" for text in self.assumptions]
        return "\n".join(lines)


def step_time(model: LlamaConfig, layout: Layout, gpu: GPU, intra: Interconnect, inter: Interconnect,
              gpus_per_node: int, efficiency: float = EFFICIENCY) -> StepTime:
    """Estimated seconds per optimizer step of `layout` training `model` on `gpu`s, `gpus_per_node` per node."""
    peak = _validate(model, layout, gpu, gpus_per_node, efficiency)
    tp_link, dp_link, pp_link = _links(layout, intra, inter, gpus_per_node)
    cp_link = intra if layout.tp * layout.cp <= gpus_per_node else inter
    n_flops, n_all = model.num_params(include_embedding=False), model.num_params()
    flops_per_token = 6 * n_flops + 12 * model.num_hidden_layers * model.hidden_size * layout.seq_len
    tokens = layout.global_batch * layout.seq_len

    compute = flops_per_token * tokens / (layout.gpus * efficiency * peak)
    recompute = compute * _recompute_fraction(model, layout, flops_per_token)
    tp_comm = _tp_comm(model, layout, tp_link)
    psi = n_all / (layout.tp * layout.pp)          # parameters this rank holds (before ZeRO sharding)
    forward = FORWARD_FRACTION * compute
    backward = compute - forward + recompute        # recompute runs inside backward
    dp_total, dp_exposed = _dp_comm(layout, psi, dp_link, forward, backward)
    bubble = _bubble(layout, compute + recompute + tp_comm)
    notes = (
        f"{flops_per_token / 1e9:.4g} GFLOP/token = 6N (N={n_flops:,}, no input embedding) + 12·L·h·s; "
        f"{efficiency:.0%} of {peak / 1e12:g} TFLOP/s {layout.precision} on {gpu.name}",
        f"links: tp {tp_link.name}, dp {dp_link.name}, pp {pp_link.name} "
        f"(mesh order pp, dp, cp, tp: tp innermost; {gpus_per_node} GPUs per node)",
        "tp: 2 all-reduces forward + 2 backward per layer per micro-batch (+2 when recomputing, +1 under "
        "selective recompute: o_proj's, and under SP the all-gathers into attention and MLP); "
        "sequence parallelism moves the same volume as all-gather + reduce-scatter; never overlapped",
        f"dp: ZeRO-{layout.zero} traffic in model dtype; overlapped traffic hidden up to {OVERLAP:.0%} "
        "of its compute window; the post-step parameter all-gather (stages 1-2) is exposed",
        "pp: one activation and one gradient send per micro-batch per chunk boundary; bubble = "
        "ideal x f/(1-f) with f = schedule's idle fraction (p-1)/(v·m + p-1)",
        f"offload: PCIe {HOST_LINK_BYTES_PER_S / 1e9:g} GB/s, NVMe {NVME_READ_BYTES_PER_S / 1e9:g}/"
        f"{NVME_WRITE_BYTES_PER_S / 1e9:g} GB/s read/write, CPU Adam {CPU_ADAM_PARAMS_PER_S:.3g} params/s; "
        "not overlapped (an upper estimate); offloaded activations go down in forward and up in backward",
    )
    return StepTime(compute=compute, recompute=recompute, tp_comm=tp_comm, dp_comm=dp_exposed,
                    pp_comm=_pp_comm(model, layout, pp_link), bubble=bubble,
                    offload=_offload(layout, psi) + _activation_offload(model, layout),
                    dp_comm_total=dp_total, tokens_per_step=tokens, flops_per_token=flops_per_token,
                    gpus=layout.gpus, peak_flops=peak, assumptions=notes + _cp_note(layout, cp_link),
                    cp_comm=_cp_comm(model, layout, cp_link))


def train_time(step: StepTime, layout: Layout, total_tokens: int) -> float:
    """Seconds to train on `total_tokens` tokens: whole steps of `layout`'s global batch."""
    if isinstance(total_tokens, bool) or not isinstance(total_tokens, int) or total_tokens < 1:
        raise ValueError(f"total_tokens must be a positive int, got {total_tokens!r}")
    tokens = layout.global_batch * layout.seq_len
    if tokens != step.tokens_per_step:
        raise ValueError(f"layout {layout.describe()} runs {tokens} tokens per step but the StepTime was priced "
                         f"for {step.tokens_per_step}; pass the layout the StepTime came from")
    return math.ceil(total_tokens / tokens) * step.total


# ---------------------------------------------------------------- components

def _links(layout: Layout, intra: Interconnect, inter: Interconnect, gpus_per_node: int):
    """(tp, dp, pp) links. Ranks are laid out pp-major, tp-minor (pp, dp, cp, tp), so a group of consecutive
    ranks stays inside a node while it fits: tp spans tp ranks, cp tp·cp, dp tp·cp·dp, and pp crosses a node
    boundary somewhere as soon as the job spans nodes."""
    tp = intra if layout.tp <= gpus_per_node else inter
    dp = intra if layout.tp * layout.cp * layout.dp <= gpus_per_node else inter
    pp = intra if layout.gpus <= gpus_per_node else inter
    return tp, dp, pp


def _ring(n: int, volume: float, link: Interconnect, steps_per_rank: int) -> float:
    """Seconds for a ring collective moving `volume` bytes per rank in `steps_per_rank` hops."""
    return volume / link.bytes_per_s + steps_per_rank * (n - 1) * link.latency_s


def _activation_bytes(model: LlamaConfig, layout: Layout) -> int:
    """One micro-batch's hidden states on one rank: micro_batch x its tokens of a row x hidden, model dtype."""
    return layout.micro_batch * layout.rank_tokens * model.hidden_size * layout.dtype_bytes


def _recompute_fraction(model: LlamaConfig, layout: Layout, flops_per_token: float) -> float:
    """Share of the step's compute that recompute adds: a third under full recompute; under selective the
    attention core's forward (4·h·s per token per layer, a third of the 12·L·h·s term) if it is recomputed,
    and o_proj's matmul under tensor parallelism (whose in-place all-reduce the recompute cannot keep)."""
    if layout.checkpointing == "full":
        return RECOMPUTE_FRACTION
    if layout.checkpointing == "none":
        return 0.0
    h = model.hidden_size
    per_layer = (4 * h * layout.seq_len if "attention" in layout.recompute_ops else 0) + \
        (2 * h * h if layout.tp > 1 else 0)
    return model.num_hidden_layers * per_layer / flops_per_token


def _tp_comm(model: LlamaConfig, layout: Layout, link: Interconnect) -> float:
    t = layout.tp
    if t == 1:
        return 0.0
    per_all_reduce = _ring(t, 2 * (t - 1) / t * _activation_bytes(model, layout), link, 2)
    # the recomputed forward all-reduces again: both (full); o_proj's, and under SP the two all-gathers
    # into attention and MLP (half an all-reduce each) (selective)
    again = {"none": 0, "full": 2, "selective": 1.5 if layout.sequence_parallel else 1}[layout.checkpointing]
    per_layer = 4 + again
    if layout.sequence_parallel:   # attention's and the MLP's inputs gathered again in backward (saved as slices)
        per_layer += 1             # two all-gathers: one all-reduce's bytes
    layers = model.num_hidden_layers / layout.pp
    return layout.grad_accum * layers * per_layer * per_all_reduce


def _dp_comm(layout: Layout, psi: float, link: Interconnect, forward: float, backward: float):
    """(all traffic, exposed) seconds. Units of u = one ring pass (d-1)/d·Ψ·bytes; buckets are
    large, so latency is ignored."""
    d, m = layout.shard_ranks, layout.grad_accum
    if d == 1:
        return 0.0, 0.0
    u = (d - 1) / d * psi * layout.dtype_bytes / link.bytes_per_s
    if layout.pp > 1:     # (hidden, window, exposed): the reduce after the schedule, the gather after the step
        per_micro = layout.zero == 3 and layout.pipeline_gather == "micro_batch"
        hidden, window, after = (2 * m, forward + backward, 1) if per_micro else (0, 0.0, 2)
        return (hidden + after) * u, max(0.0, hidden * u - OVERLAP * window) + after * u
    # stage -> (overlapped passes, window that hides them, passes after the step)
    hidden, window, after = {
        0: (2, backward / m, 0),            # all-reduce = reduce-scatter + all-gather, last micro-step
        1: (1, backward / m, 1),
        2: (m, backward, 1),
        3: (3 * m, forward + backward, 0),  # gathers prefetched in forward and backward
    }[layout.zero]
    total = (hidden + after) * u
    return total, max(0.0, hidden * u - OVERLAP * window) + after * u


def _pp_comm(model: LlamaConfig, layout: Layout, link: Interconnect) -> float:
    """1F1B steady state: per micro-batch and model chunk, one activation in, one gradient out.
    Under sequence parallelism each tensor-parallel rank sends only its sequence shard."""
    if layout.pp == 1:
        return 0.0
    size = _activation_bytes(model, layout) / (layout.tp if layout.sequence_parallel else 1)
    sends = 2 * layout.grad_accum * layout.virtual_stages
    return sends * (size / link.bytes_per_s + link.latency_s)


def cp_kv_bytes(model: LlamaConfig, layout: Layout) -> float:
    """Bytes one rank receives per layer and micro-batch in the K/V all-gather: (cp-1)/cp of the whole row's
    K and V (its tensor-parallel share of the key/value heads); its backward reduce-scatter moves as much."""
    c = layout.cp
    kv = 2 * layout.micro_batch * layout.seq_len * model.num_key_value_heads * model.head_dim / layout.tp
    return (c - 1) / c * kv * layout.dtype_bytes


def _cp_comm(model: LlamaConfig, layout: Layout, link: Interconnect) -> float:
    if layout.cp == 1:
        return 0.0
    one = _ring(layout.cp, cp_kv_bytes(model, layout), link, 1)
    again = 1 if layout.checkpointing == "full" or "attention" in layout.recompute_ops and \
        layout.checkpointing == "selective" else 0
    layers = model.num_hidden_layers / layout.pp
    return layout.grad_accum * layers * (2 + again) * one


def _cp_note(layout: Layout, link: Interconnect) -> tuple:
    if layout.cp == 1:
        return ()
    return (f"cp: per layer and micro-batch an all-gather of K and V forward ((cp-1)/cp of the row's K/V, "
            f"over {link.name}) and a reduce-scatter of their gradients backward, again when recompute reruns "
            "attention; ZeRO and gradients over dp x cp; never overlapped",)


def _bubble(layout: Layout, ideal: float) -> float:
    """theory_bubble is idle / (ideal + idle), so idle = ideal x f / (1 - f) = ideal (p-1)/(v m)."""
    if layout.pp == 1:
        return 0.0
    f = theory_bubble(layout.schedule, layout.pp, layout.grad_accum, layout.virtual_stages)
    return ideal * f / (1 - f)


def _offload(layout: Layout, psi: float) -> float:
    """Host traffic and the CPU optimizer step for this rank's ZeRO shard (Ψ/dp parameters)."""
    shard, b, m = psi / layout.shard_ranks, layout.dtype_bytes, layout.grad_accum
    seconds = 0.0
    if layout.offload_optimizer != "none":
        seconds += shard * (GRAD_SHARD_BYTES + b) / HOST_LINK_BYTES_PER_S   # gradients down, weights up
        seconds += shard / CPU_ADAM_PARAMS_PER_S
        if layout.offload_optimizer == "nvme":
            states = shard * (MASTER_BYTES + optimizer_state_bytes_per_param(layout.optimizer))
            seconds += states / NVME_READ_BYTES_PER_S + states / NVME_WRITE_BYTES_PER_S
    if layout.offload_param != "none":
        reads, writes = 2 * m * shard * b, shard * b   # forward and backward gathers; updated shard back
        seconds += (reads + writes) / HOST_LINK_BYTES_PER_S
        if layout.offload_param == "nvme":
            seconds += reads / NVME_READ_BYTES_PER_S + writes / NVME_WRITE_BYTES_PER_S
    return seconds


def _activation_offload(model: LlamaConfig, layout: Layout) -> float:
    """Offloaded blocks' saved activations: to the host in forward, back in backward, every micro-batch."""
    if not layout.offload_blocks:
        return 0.0
    micro = Micro(layout.micro_batch, layout.rank_tokens, layout.dtype_bytes, layout.tp, layout.sequence_parallel,
                  cp=layout.cp)
    _, host = offloaded_per_block(model, micro, layout.checkpointing, layout.recompute_ops)
    blocks = offloaded_count(layout.offload_blocks, model.num_hidden_layers / layout.pp)
    return 2 * layout.grad_accum * blocks * host / HOST_LINK_BYTES_PER_S


# ---------------------------------------------------------------- validation

def _validate(model: LlamaConfig, layout: Layout, gpu: GPU, gpus_per_node: int, efficiency: float) -> float:
    """Reject layouts the engine would reject, with the arithmetic and the fix; return the peak FLOP/s."""
    if isinstance(efficiency, bool) or not isinstance(efficiency, (int, float)) or not 0 < efficiency <= 1:
        raise ValueError(f"efficiency is the fraction of peak FLOP/s reached, in (0, 1]; got {efficiency!r}; "
                         f"use e.g. {EFFICIENCY}")
    if isinstance(gpus_per_node, bool) or not isinstance(gpus_per_node, int) or gpus_per_node < 1:
        raise ValueError(f"gpus_per_node must be a positive int, got {gpus_per_node!r}")
    peak = gpu.flops(layout.precision)
    if layout.gpus > gpus_per_node and layout.gpus % gpus_per_node:
        raise ValueError(f"dp {layout.dp} x cp {layout.cp} x tp {layout.tp} x pp {layout.pp} = {layout.gpus} GPUs is "
                         f"not a whole number of {gpus_per_node}-GPU nodes; use a multiple of {gpus_per_node} GPUs "
                         f"or pass the GPUs used per node as gpus_per_node")
    if layout.cp > 1 and layout.seq_len % (2 * layout.cp * (layout.tp if layout.sequence_parallel else 1)):
        raise ValueError(f"context parallelism cuts seq_len {layout.seq_len} into 2 x cp {layout.cp} chunks"
                         + (f" and sequence parallelism each rank's share over tp {layout.tp}"
                            if layout.sequence_parallel else "") + "; use a seq_len that divides so")
    if layout.tp > 1:
        check_llama(model, layout.tp)
        if layout.sequence_parallel and layout.rank_tokens % layout.tp:
            raise ValueError(f"sequence parallelism splits seq_len {layout.seq_len} over tp {layout.tp}, which "
                             f"does not divide it; use a seq_len that is a multiple of {layout.tp}")
    _validate_pipeline(model, layout)
    if layout.offload_optimizer != "none" and layout.zero == 0:
        raise ValueError(f"offload_optimizer {layout.offload_optimizer!r} needs ZeRO stage 1-3, got zero 0; "
                         "set zero to 1, 2 or 3")
    if layout.offload_param != "none" and layout.zero != 3:
        raise ValueError(f"offload_param {layout.offload_param!r} needs ZeRO stage 3 (sharded parameters), got "
                         f"zero {layout.zero}; set zero to 3 or offload_param to 'none'")
    if layout.optimizer.lower() not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {layout.optimizer!r}; the cost model knows "
                         f"{', '.join(OPTIMIZERS.values())}")
    return peak


def _validate_pipeline(model: LlamaConfig, layout: Layout) -> None:
    p, m, v, layers = layout.pp, layout.grad_accum, layout.virtual_stages, model.num_hidden_layers
    if p == 1:
        if v > 1:
            raise ValueError(f"virtual_stages {v} needs pipeline parallelism, got pp 1; set virtual_stages to 1")
        return
    theory_bubble(layout.schedule, p, m, v)   # rejects unknown schedules and v > 1 without interleaving
    if p * v > layers:
        raise ValueError(f"pp {p} x virtual_stages {v} = {p * v} model chunks but the model has {layers} layers; "
                         f"use at most {layers} chunks")
    if m < p:
        raise ValueError(f"pipeline needs at least `stages` micro-batches: grad_accum m={m} < pp p={p}; "
                         f"raise grad_accum to {p}")
    if v > 1 and m % p:
        raise ValueError(f"interleaved schedule needs micro-batches m={m} to be a multiple of pp p={p}; "
                         f"set grad_accum to {-(-m // p) * p}")
