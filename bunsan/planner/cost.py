"""Seconds per optimizer step for a layout: an analytic model the planner ranks layouts with.

    total = compute + recompute + tp_comm + dp_comm (exposed) + pp_comm + bubble + offload + optimizer
            + cp_comm + ep_comm

Compute is priced per GEMM of the block (planner/compute.py: a roofline of FLOPs at a GEMM efficiency and
bytes at the HBM bandwidth, plus the element-wise rest), on the pipeline stage with the most blocks (and
the head). Collectives are latency + size / bandwidth over the real topology (planner/collectives.py):
NVLink inside a node, the per-GPU share of the inter-node fabric across, ring or tree, with the group's
size. What overlaps and what does not:

    tensor parallel   all-reduces (or SP's all-gathers and reduce-scatters) on the critical path
    stage 0-2         gradient buckets reduce while backward runs, hidden up to the backward's length; the
                      last bucket is exposed; stages 1-2 gather the parameters after the step (exposed)
    stage 3           each block's gather hides behind the block before's compute only (prefetch depth
                      1), in forward and again in backward, where its reduce-scatter shares the link
    pipeline          every stage reduces once after the schedule, exposed (nothing computes then); ZeRO-3
                      gathers per micro-batch in forward and backward (as stage 3), or once before the
                      schedule (exposed) with stage3_pipeline_gather "schedule"; bubble and sends exposed
    recompute         the recomputed forward runs inside backward, on the critical path
    context parallel  per layer and micro-batch the K/V all-gather (forward, again under recompute) and the
                      reduce-scatter of their gradients, on the critical path; cp ranks are data parallel
                      for gradients (ZeRO over dp x cp)
    expert parallel   a MoE block's dispatch and combine all-to-alls, forward and backward (again under full
                      recompute), on the critical path; the experts' gradients reduce over their own dp x cp /
                      ep ranks, beside the dense parameters' over dp x cp

That is bunsan's engine. `overlap` prices another framework's overlaps (OVERLAPS; Megatron-Core's flags), each
hidden up to the compute it runs beside, one block's share at least exposed.

Every constant is in planner/constants.py (and hardware.py) with its source. Every figure is an estimate;
`benchmarks/bench_planner.py` checks it against published runs, `benchmarks/` measures the real thing.
"""

from __future__ import annotations

import dataclasses
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
from bunsan.planner import constants as K
from bunsan.planner.collectives import Topology, collective, p2p
from bunsan.planner.compute import BlockTime, block_time, head_time, optimizer_time
from bunsan.planner.assumptions import step_notes
from bunsan.planner.experts import ep_comm, routed_expert_params
from bunsan.planner.context import cp_chunk, cp_comm, cp_kv_bytes, cp_note  # noqa: F401  (cp_kv_bytes: the API)

EFFICIENCY = K.GEMM_EFFICIENCY   # the default GEMM efficiency (`efficiency=` overrides it)
# Communication other frameworks overlap and bunsan's engine does not (`overlap=`; Megatron-Core's flags):
OVERLAPS = {
    "tp": "tensor-parallel collectives beside the GEMMs they feed (--tp-comm-overlap)",
    "grad_reduce": "under pipeline stages, each stage's gradient reduce beside its last micro-batch's backward "
                   "(--overlap-grad-reduce; without stages bunsan's engine overlaps it too)",
    "param_gather": "ZeRO-1/2's parameter all-gather beside the next step's first forward (--overlap-param-gather)",
}
MASTER_BYTES = 4
GRAD_SHARD_BYTES = 4   # bunsan keeps the reduced gradient shard in fp32 (zero/optimizer.py)
# Host-side figures (estimates; see hardware.py).
HOST_LINK_BYTES_PER_S = hardware.HOST_LINK_BYTES_PER_S
NVME_READ_BYTES_PER_S = hardware.NVME_READ_BYTES_PER_S
NVME_WRITE_BYTES_PER_S = hardware.NVME_WRITE_BYTES_PER_S
CPU_ADAM_PARAMS_PER_S = hardware.CPU_ADAM_PARAMS_PER_S

COMPONENTS = ("compute", "recompute", "tp_comm", "dp_comm", "pp_comm", "bubble", "offload", "optimizer", "cp_comm",
              "ep_comm")


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
    optimizer: float         # the optimizer step on the GPU (offloaded steps are in `offload`)
    dp_comm_total: float     # all data-parallel traffic, before overlap
    tokens_per_step: int
    flops_per_token: float   # 6N + 12·L·h·s
    gpus: int
    peak_flops: float        # per GPU, dense, for the layout's precision
    assumptions: tuple = ()
    cp_comm: float = 0.0     # context parallel: the K/V all-gathers and their gradients' reduce-scatters
    ep_comm: float = 0.0     # expert parallel: the MoE blocks' dispatch and combine all-to-alls

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
              gpus_per_node: int, efficiency: float | None = None, attention: str = "flash",
              compiled: bool = False, overlap: tuple = (), qk_norm: bool = False) -> StepTime:
    """Estimated seconds per optimizer step of `layout` training `model` on `gpu`s, `gpus_per_node` per node.
    `efficiency` is the fraction of the tensor-core peak a large GEMM reaches (default GEMM_EFFICIENCY);
    `attention` "materialized" prices a kernel that writes the scores out (no flash attention); `compiled`
    prices torch.compile's fused element-wise ops (`train.compile`), else eager PyTorch's op-by-op passes;
    `overlap` the communication another framework overlaps (OVERLAPS), for pricing its runs; `qk_norm` blocks
    that keep their q/k norms' inputs too (a Qwen3's: activations.Micro.qk_norm), in offloaded activations."""
    unknown = [o for o in overlap if o not in OVERLAPS]
    if unknown:
        raise ValueError(f"overlap {unknown}: not one of {', '.join(OVERLAPS)}")
    eff = K.GEMM_EFFICIENCY if efficiency is None else efficiency
    peak = _validate(model, layout, gpu, gpus_per_node, eff)
    topo = Topology(gpus_per_node, intra, inter)
    # (a MoE model's FLOPs are its active parameters': the top_k experts a token passes)
    n_flops, n_all = model.num_params(include_embedding=False, active=True), model.num_params()
    flops_per_token = 6 * n_flops + 12 * model.num_hidden_layers * model.attention_dim * layout.seq_len
    tokens, m = layout.global_batch * layout.seq_len, layout.grad_accum
    # Under context parallelism a rank computes its seq_len/cp tokens of each row against the whole row's keys (the
    # balanced causal split); to its GEMMs its cp peers are data-parallel ones (dp x cp kept: ep folds over them)
    local = dataclasses.replace(layout, seq_len=layout.rank_tokens, cp=1, dp=layout.shard_ranks) \
        if layout.cp > 1 else layout
    blk = block_time(model, local, gpu, eff, attention, keys=layout.seq_len, chunk=cp_chunk(layout),
                     compiled=compiled)
    blocks = stage_blocks(model, layout)
    head = head_time(model, local, gpu, eff)
    compute = m * (blocks * (blk.forward + blk.backward) + head)
    recompute = m * blocks * _recompute_per_block(layout, blk)
    tp_comm = _tp_comm(model, local, topo, blocks)
    if "tp" in overlap:
        tp_comm = _hidden(tp_comm, compute + recompute, m * blocks)
    # parameters this rank holds before ZeRO sharding: the dense ones, and the routed experts' 1/ep share,
    # whose gradients reduce over dp x cp / ep ranks
    experts = routed_expert_params(model)
    psi = (n_all - experts) / (layout.tp * layout.pp)
    psi_experts = experts / (layout.tp * layout.pp * layout.ep)
    per_block = recompute / max(1, m * blocks)
    dp_total, dp_exposed = _dp_comm(layout, psi, topo, blk, blocks, per_block, overlap)
    if psi_experts:
        ex_total, ex_exposed = _dp_comm(layout, psi_experts, topo, blk, blocks, per_block, overlap,
                                        group=layout.expert_shard_ranks, stride=layout.tp * layout.ep)
        dp_total, dp_exposed = dp_total + ex_total, dp_exposed + ex_exposed
    bubble = _bubble(layout, compute + recompute + tp_comm)
    # a ZeRO shard: the dense 1/(dp cp) and the experts' 1/(dp cp / ep) of a 1/ep share, `sharded` over dp x cp
    sharded = psi + psi_experts * layout.ep
    shard = sharded / layout.shard_ranks if layout.zero else psi + psi_experts
    optimizer = 0.0 if layout.offload_optimizer != "none" else optimizer_time(shard, gpu)
    return StepTime(compute=compute, recompute=recompute, tp_comm=tp_comm, dp_comm=dp_exposed,
                    pp_comm=_pp_comm(model, layout, topo), bubble=bubble,
                    offload=_offload(layout, sharded) + _activation_offload(model, layout, qk_norm),
                    optimizer=optimizer, dp_comm_total=dp_total, tokens_per_step=tokens,
                    flops_per_token=flops_per_token, gpus=layout.gpus, peak_flops=peak,
                    cp_comm=cp_comm(model, layout, topo, blocks), ep_comm=ep_comm(model, local, topo, blocks),
                    assumptions=step_notes(model, layout, gpu, topo, eff, attention, n_flops, flops_per_token, compiled,
                                               overlap)
                    + cp_note(layout, topo, attention, gpu)
                    + tuple(f"overlapped (another framework's): {OVERLAPS[o]}" for o in overlap))


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

def stage_blocks(model: LlamaConfig, layout: Layout) -> int:
    """Blocks on the busiest pipeline rank. The engine's uniform partition (pipeline/partition.py) gives
    each of the p x v chunks L // (p v) blocks and the first L mod (p v) chunks one more; rank 0 holds
    chunks 0, p, 2p, ..., so it is the busiest."""
    p, v = layout.pp, layout.virtual_stages
    base, extra = divmod(model.num_hidden_layers, p * v)
    return sum(base + (1 if c * p < extra else 0) for c in range(v))


def _activation_bytes(model: LlamaConfig, layout: Layout) -> int:
    """One micro-batch's hidden states: micro_batch x seq x hidden in the model dtype."""
    return layout.micro_batch * layout.seq_len * model.hidden_size * layout.dtype_bytes


def _recompute_per_block(layout: Layout, blk: BlockTime) -> float:
    """Seconds recompute adds per block and micro-batch: the whole forward under full recompute; under
    selective the attention core's forward (if it is recomputed) and o_proj's GEMM under tensor parallelism
    (whose in-place all-reduce the recompute cannot keep)."""
    if layout.checkpointing == "full":
        return blk.forward
    if layout.checkpointing == "none":
        return 0.0
    return (blk.attention_forward if "attention" in layout.recompute_ops else 0.0) + \
        (blk.o_proj_forward if layout.tp > 1 else 0.0)


def _tp_comm(model: LlamaConfig, layout: Layout, topo: Topology, blocks: int) -> float:
    t = layout.tp
    if t == 1:
        return 0.0
    per_all_reduce = collective("all_reduce", _activation_bytes(model, layout), t, 1, topo)
    # the recomputed forward all-reduces again: both (full); o_proj's, and under SP the two all-gathers
    # into attention and MLP (half an all-reduce each) (selective)
    again = {"none": 0, "full": 2, "selective": 1.5 if layout.sequence_parallel else 1}[layout.checkpointing]
    per_layer = 4 + again
    if layout.sequence_parallel:   # attention's and the MLP's inputs gathered again in backward (saved as slices)
        per_layer += 1             # two all-gathers: one all-reduce's bytes
    return layout.grad_accum * blocks * per_layer * per_all_reduce


def _dp_comm(layout: Layout, psi: float, topo: Topology, blk: BlockTime, blocks: int, recompute: float,
             overlap: tuple = (), group: int | None = None, stride: int | None = None):
    """(all traffic, exposed) seconds of the data-parallel group (dp x cp ranks, tp apart: context-parallel
    ranks are data parallel for gradients), or of `group` ranks `stride` apart (the experts' dp x cp / ep);
    `overlap`: step_time's."""
    d, m = group or layout.shard_ranks, layout.grad_accum
    if d == 1:
        return 0.0, 0.0
    size = psi * layout.dtype_bytes

    def coll(kind: str, nbytes: float) -> float:
        return collective(kind, nbytes, d, stride or layout.tp, topo)

    backward = blocks * (blk.backward + recompute)       # one micro-step's backward on this rank
    if layout.pp > 1:
        return _dp_under_pipeline(layout, size, coll, blk, blocks, recompute, overlap)
    if layout.zero == 3:
        fwd, bwd, total = _zero3_micro_step(size / blocks, coll, blk, blocks, recompute, reduce=True)
        return m * total, m * (fwd + bwd)
    reduce = coll("all_reduce" if layout.zero == 0 else "reduce_scatter", size)
    gather = coll("all_gather", size) if layout.zero else 0.0
    reduces = m if layout.zero == 2 else 1     # stage 2 reduces every micro-step, 0-1 the last one
    exposed = reduces * _hidden(reduce, backward, blocks) + (
        _hidden(gather, blocks * blk.forward, blocks) if "param_gather" in overlap else gather)
    return reduces * reduce + gather, exposed


def _hidden(traffic: float, window: float, blocks: int) -> float:
    """Exposed seconds of `traffic` issued through a `window` of compute, bucket by bucket (a block's
    gradients each): what outlasts the window, and at least the last bucket, which nothing hides."""
    return max(traffic - window, traffic / blocks)


def _zero3_micro_step(unit_bytes: float, coll, blk: BlockTime, blocks: int, recompute: float, reduce: bool):
    """(forward exposed, backward exposed, all traffic) of ZeRO-3 on one micro-step: block i+1's gather
    (prefetched) hides behind block i's compute only; in backward the re-gather and the reduce-scatter of
    the block's gradients share the link. The first gather of each pass and the last reduce are exposed."""
    g = coll("all_gather", unit_bytes)
    r = coll("reduce_scatter", unit_bytes) if reduce else 0.0
    fwd = g + (blocks - 1) * max(0.0, g - blk.forward)
    bwd = g + (blocks - 1) * max(0.0, g + r - blk.backward - recompute) + r
    return fwd, bwd, blocks * (2 * g + r)


def _dp_under_pipeline(layout: Layout, size: float, coll, blk: BlockTime, blocks: int, recompute: float,
                       overlap: tuple):
    """Under pipeline stages every stage reduces once after the schedule (exposed); stages 1-2 gather after
    the step; ZeRO-3 gathers per micro-batch in forward and backward, or once before the schedule. With
    `overlap` (step_time's) the reduce hides behind the last micro-batch's backward, the gather behind the
    next step's first forward."""
    m = layout.grad_accum
    reduce = coll("all_reduce" if layout.zero == 0 else "reduce_scatter", size)
    exposed = _hidden(reduce, blocks * (blk.backward + recompute), blocks) if "grad_reduce" in overlap else reduce
    if layout.zero == 0:
        return reduce, exposed
    gather = coll("all_gather", size)
    if layout.zero == 3 and layout.pipeline_gather == "micro_batch":
        fwd, bwd, total = _zero3_micro_step(size / blocks, coll, blk, blocks, recompute, reduce=False)
        return m * total + reduce, m * (fwd + bwd) + exposed
    hidden_gather = "param_gather" in overlap and layout.zero in (1, 2)
    return reduce + gather, exposed + (_hidden(gather, blocks * blk.forward, blocks) if hidden_gather else gather)


def _pp_comm(model: LlamaConfig, layout: Layout, topo: Topology) -> float:
    """1F1B steady state: per micro-batch and model chunk, one activation in, one gradient out.
    Under sequence parallelism each tensor-parallel rank sends only its sequence shard."""
    if layout.pp == 1:
        return 0.0
    size = _activation_bytes(model, layout) / (layout.tp if layout.sequence_parallel else 1)
    sends = 2 * layout.grad_accum * layout.virtual_stages
    return sends * p2p(size / layout.cp, topo.link(layout.pp, layout.tp * layout.shard_ranks))


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


def _activation_offload(model: LlamaConfig, layout: Layout, qk_norm: bool = False) -> float:
    """Offloaded blocks' saved activations: to the host in forward, back in backward, every micro-batch."""
    if not layout.offload_blocks:
        return 0.0
    micro = Micro(layout.micro_batch, layout.seq_len, layout.dtype_bytes, layout.tp, layout.sequence_parallel,
                  qk_norm=qk_norm)
    _, host = offloaded_per_block(model, micro, layout.checkpointing, layout.recompute_ops)
    blocks = offloaded_count(layout.offload_blocks, model.num_hidden_layers / layout.pp)
    return 2 * layout.grad_accum * blocks * host / HOST_LINK_BYTES_PER_S


# ---------------------------------------------------------------- validation

def _validate(model: LlamaConfig, layout: Layout, gpu: GPU, gpus_per_node: int, efficiency: float) -> float:
    """Reject layouts the engine would reject, with the arithmetic and the fix; return the peak FLOP/s."""
    if isinstance(efficiency, bool) or not isinstance(efficiency, (int, float)) or not 0 < efficiency <= 1:
        raise ValueError(f"efficiency is the fraction of the tensor-core peak a large GEMM reaches, in (0, 1]; "
                         f"got {efficiency!r}; use e.g. {EFFICIENCY}")
    if isinstance(gpus_per_node, bool) or not isinstance(gpus_per_node, int) or gpus_per_node < 1:
        raise ValueError(f"gpus_per_node must be a positive int, got {gpus_per_node!r}")
    peak = gpu.flops(layout.precision)
    if layout.gpus > gpus_per_node and layout.gpus % gpus_per_node:
        raise ValueError(f"dp {layout.dp} x cp {layout.cp} x tp {layout.tp} x pp {layout.pp} = {layout.gpus} GPUs is "
                         f"not a whole "
                         f"number of {gpus_per_node}-GPU nodes; use a multiple of {gpus_per_node} GPUs "
                         f"or pass the GPUs used per node as gpus_per_node")
    moe = model.moe_config()
    if layout.ep > 1 and (moe is None or moe.num_experts % layout.ep):
        raise ValueError(f"ep {layout.ep}: expert parallelism splits a MoE model's experts, " + (
            "and this model has none; use ep 1" if moe is None else
            f"and {moe.num_experts} experts do not split over it; use an ep that divides {moe.num_experts}"))
    if layout.tp > 1:
        check_llama(model, layout.tp)
        if layout.sequence_parallel and layout.seq_len % layout.tp:
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
