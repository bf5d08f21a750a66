"""`bunsan.estimate`: the memory one GPU (and one host) needs for a model under a layout, line by line.

Peak = runtime + resident model states + the larger of two phases:
  backward  activations kept for backward (all micro-batches in flight under PP) + the logits
            gradients at the start of backward (or one block recomputed, or brought back from host memory)
            + ZeRO-3's gathered units + the gradient buckets being reduced
  step      the fp32 gradient shard (ZeRO-1 makes it at the last reduce) + optimizer temporaries
Every pipeline rank is priced; the table shows the fullest one. Under context parallelism a rank holds
seq_len / cp tokens of each row (its activations are priced for those), keeps the whole sequence's K and V
for attention's backward, and shares ZeRO shards with its dp x cp peers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from bunsan.pipeline import schedules
from bunsan.estimator.layout import Layout
from bunsan.comm.shm import ring_bytes
from bunsan.comm.mailbox import resident_bytes
from bunsan.estimator.activations import Micro, block_input_bytes
from bunsan.estimator.recompute import stage_bytes
from bunsan.estimator.rank_params import RankParams, lora_rank_params, rank_params
from bunsan.estimator.shape import ModelShape, load_shape
from bunsan.memory.theory import (grad_shard_elems, gradient_bucket_bytes, model_states, nvme_swap_in_bytes,
                                  placement, with_frozen_base, zero3_gathered_bytes)
from bunsan.models.llama import LlamaConfig
from bunsan.zero.reduce import IN_FLIGHT

GiB = 1024 ** 3
# Not visible to torch.cuda.max_memory_allocated but taken from the GPU: CUDA context, kernels, cuBLAS and
# NCCL workspaces. A typical figure for torch on H100/A100; measure yours (nvidia-smi minus allocated).
CUDA_RUNTIME_BYTES = 0.75 * GiB
# Resident set of a CPU worker before the model: Python, torch, gloo (calibrated on CPU runs: benchmarks/RESULTS.md,
# memory estimator and planner).
CPU_RUNTIME_BYTES = 0.23 * GiB
# What a CPU worker keeps resident after its first step that no tensor accounts for: the math library's
# buffers and heap the allocator cannot return: the resident set after malloc_trim beyond the runtime and the
# gc-visible tensors (which are the model states exactly); calibrated as CPU_RUNTIME_BYTES is.
CPU_WORKSPACE_BYTES = 96 * 1024 ** 2
# Host memory of each GPU process besides offloaded states (CUDA libraries, pinned staging): assumed.
HOST_PROCESS_BYTES = 2 * GiB
KEPT_UNDER = {"none": "saved for backward", "full": "block inputs (checkpointed)",
              "selective": "block inputs and matmul outputs (selective recompute)"}


@dataclass
class Item:
    name: str
    device: float = 0.0
    host: float = 0.0
    disk: float = 0.0
    phase: str = "always"     # always | backward | step: which part of the peak it belongs to
    note: str = ""


@dataclass
class Estimate:
    model: str
    n_params: int
    layout: Layout
    nodes: int
    device_type: str
    gpu_memory: float | None
    items: list[Item]                         # the fullest pipeline rank
    rank: int                                 # its pipeline rank
    model_states: dict                        # its resident model-state bytes by kind, device/host/disk
    stage_peaks: list[float] = field(default_factory=list)    # peak of every pipeline rank
    stage_states: list[dict] = field(default_factory=list)    # model states of every pipeline rank
    shape: ModelShape | None = field(default=None, repr=False)
    # what every pipeline rank holds, priced above: the trained parameters, and the frozen ones (LoRA's base, a
    # frozen encoder) held as weights only; the ZeRO-by-stage table prices the same (cli/plan_json.zero_stages)
    trained: list[RankParams] = field(default_factory=list, repr=False)
    frozen: list[RankParams] | None = field(default=None, repr=False)

    @property
    def peak(self) -> float:
        """Peak bytes on one GPU (on a CPU run: the process's resident set)."""
        return _peak(self.items)

    @property
    def peak_without_backward(self) -> float:
        """The peak's part no activation offload moves (the items held always and at the step: model states,
        runtime, the step's buffers): a floor under the peak of the same layout with any blocks offloaded."""
        return _peak([i for i in self.items if i.phase != "backward"])

    @property
    def host_per_node(self) -> float:
        per_rank = sum(i.host for i in self.items)
        return per_rank * self.layout.gpus / self.nodes

    @property
    def disk_per_node(self) -> float:
        return sum(i.disk for i in self.items) * self.layout.gpus / self.nodes

    @property
    def headroom(self) -> float | None:
        return None if self.gpu_memory is None else self.gpu_memory - self.peak

    def fits(self, margin: float | None = None) -> bool:
        """Peak within the GPU's memory by the rule `bunsan plan` ranks with (estimator/margin.py): within it even
        if the estimate is as low as measured; `margin`, a fraction kept free, makes it a flat cut instead."""
        from bunsan.estimator.margin import MemoryRule
        return MemoryRule.of(margin).fits(self.peak, self.gpu_memory)


def _in_flight(layout: Layout, rank: int) -> int:
    if layout.pp == 1:
        return 1
    return schedules.in_flight_bound(layout.schedule, layout.pp, layout.grad_accum, layout.virtual_stages, rank)


@dataclass(frozen=True)
class ZeroStage:
    """What a ZeRO stage puts in the table besides memory/theory.py's bytes: its notes, its own items."""
    params: str                 # the parameters' note (formatted with elements, dp)
    grads: str                  # the gradients' (formatted with precision)
    sharded: str                # after the master weights' and optimizer states' notes
    buckets: str | None         # the gradient buckets reduced in backward; None: none beside the flat buffer
    gathers: bool = False       # gathers parameters unit by unit in backward
    shard_at_step: bool = False  # makes the fp32 gradient shard at the last reduce, for the step


ZERO_STAGES = {
    0: ZeroStage("{elements:,} elements", "{precision}, full", "", None),
    1: ZeroStage("{elements:,} elements", "{precision}, full", ", sharded",
                 f"{IN_FLIGHT + 1} buckets being reduced (outputs)", shard_at_step=True),
    2: ZeroStage("{elements:,} elements", "fp32 shard", ", sharded", f"{IN_FLIGHT + 1} buckets being reduced"),
    3: ZeroStage("{elements:,} elements, sharded over {dp}", "fp32 shard", ", sharded",
                 "root unit's and one block's gradients", gathers=True),
}


def _rank_items(shape: ModelShape, rp: RankParams, rank: int, layout: Layout, device_type: str,
                runtime: float, zero: dict, opt_params: dict,
                base: RankParams | None = None) -> tuple[list[Item], dict]:
    """One pipeline rank's items in the table's order (the process, its model states, what backward adds,
    what the step adds) and its model states. `base`: the frozen weights (LoRA's base, a frozen encoder) beside
    the trained ones `rp`."""
    on_cpu = device_type == "cpu"
    bucket = int(zero.get("reduce_bucket_size", 10_000_000))
    st = _states(rp, layout, opt_params, bucket, on_cpu)
    frozen = base.total if base is not None else 0
    st = with_frozen_base(st, frozen, layout.shard_ranks, layout.zero, layout.dtype_bytes)
    items = (_process_items(layout, runtime, on_cpu)
             + _model_state_items(st, rp, frozen, layout, on_cpu)
             + (_unpriced_activations(shape) if shape.priced_as is None and not shape.bare else
                _activation_items(None if shape.bare else shape.priced_as, rp, rank, layout, on_cpu,
                                  shape.llama is None, shape.qk_norm))
             + ([Item("encoder activations", phase="backward", note="NOT PRICED: " + shape.unpriced_encoders)]
                if shape.unpriced_encoders and rp.has_embedding else [])
             + _backward_buffer_items(shape, rp, base, layout, bucket)
             + _step_items(shape, rp, st, layout, zero, on_cpu))
    return items, st


def _states(rp: RankParams, layout: Layout, opt_params: dict, bucket: int, on_cpu: bool) -> dict:
    """The rank's model states: under expert parallelism the dense parameters' over dp x cp ranks and the
    experts' share over their own dp x cp / ep (zero/experts.py), added kind by kind."""
    def states(part: RankParams, ranks: int) -> dict:
        return model_states(part, ranks, layout.zero, layout.dtype_bytes, layout.optimizer, opt_params, bucket,
                            layout.offload_optimizer, layout.offload_param, on_cpu=on_cpu)
    st = states(rp, layout.shard_ranks)
    if rp.experts is None:
        return st
    ex = states(rp.experts, layout.expert_shard_ranks)
    out = {k: v + ex[k] for k, v in st.items() if k != "on_disk"}
    out["on_disk"] = {k: st["on_disk"].get(k, 0.0) + ex["on_disk"].get(k, 0.0)
                      for k in {**st["on_disk"], **ex["on_disk"]}}
    return out


def _unpriced_activations(shape: ModelShape) -> list[Item]:
    """A model other than bunsan's Llama: its activations are not priced, and the table says so (the peak
    is a floor)."""
    return [Item("activations", phase="backward", note=f"NOT PRICED: {shape.name} is not bunsan's Llama; the peak "
                 "below leaves them out (measure a step: engine.memory_report())")]


def _process_items(layout: Layout, runtime: float, on_cpu: bool) -> list[Item]:
    """What the process holds besides the model: its runtime; on a CPU run the math library's workspace and
    the shared-memory rings of its collectives, on a GPU run the process's host memory."""
    if not on_cpu:
        return [Item("runtime", device=runtime, note="CUDA context and workspaces (typical)"),
                Item("host process", host=HOST_PROCESS_BYTES, note="CUDA libraries, pinned buffers (assumed)")]
    items = [Item("runtime", device=runtime, note="process before the model"),
             Item("math library workspace", device=CPU_WORKSPACE_BYTES, note="measured after a first step")]
    # (with dp 1 the context-parallel group is the gradients' group too: one ring)
    data = layout.shard_ranks if layout.dp > 1 else 1
    groups = [(w, g) for w, g in (("data", data), ("context", layout.cp), ("tensor", layout.tp)) if g > 1]
    if groups:      # gloo collectives through shared memory
        items.append(Item("collective buffers", device=sum(ring_bytes(g) for _, g in groups),
                          note="a shared-memory ring per " + " and ".join(w for w, _ in groups)
                          + "-parallel group of this rank (train.gloo_collectives: shm)"))
    return items


def _model_state_items(st: dict, rp: RankParams, frozen: int, layout: Layout, on_cpu: bool) -> list[Item]:
    """Parameters, gradients, master weights and optimizer states, each where it lives (device, host, NVMe)."""
    words = ZERO_STAGES[layout.zero]
    params = words.params.format(elements=rp.total + frozen, dp=layout.shard_ranks)
    if rp.experts is not None:
        params += (f"; and {rp.experts.total:,} of the routed experts' (1/{layout.ep} of them)"
                   + (f", sharded over {layout.expert_shard_ranks}" if words.gathers else ""))
    if frozen:
        params += f" ({frozen:,} frozen: no gradients or optimizer states; {rp.total:,} trained)"
    notes = {"params": params, "grads": words.grads.format(precision=layout.precision),
             "master_weights": "fp32" + words.sharded, "optimizer_states": layout.optimizer + words.sharded}
    place = placement(layout.zero, layout.offload_optimizer, layout.offload_param)
    items = []
    for kind, note in notes.items():
        if place[kind] == "nvme":
            items.append(Item(kind, disk=st["on_disk"][kind], note=note + ", on NVMe"))
        elif place[kind] == "cpu" and not on_cpu:
            items.append(Item(kind, host=st[kind], note=note + ", in host memory"))
        else:
            items.append(Item(kind, device=st[kind], note=note))
    return items


def _activation_items(c: LlamaConfig | None, rp: RankParams, rank: int, layout: Layout,
                      on_cpu: bool, transformers_blocks: bool = False, qk_norm: bool = False) -> list[Item]:
    """A Llama's activations kept for backward, the transient at its start, and under PP the stage's messages.
    `transformers_blocks`: a transformers model's Llama-form blocks, priced as a Llama block of their shape
    (`qk_norm`: with Qwen3's q/k norms)."""
    if c is None:
        return []
    micro = Micro(layout.micro_batch, layout.rank_tokens, layout.dtype_bytes, layout.tp, layout.sequence_parallel,
                  device="cpu" if on_cpu else "cuda", cp=layout.cp,
                  padding_mask=layout.padding_mask and transformers_blocks, qk_norm=qk_norm and transformers_blocks)
    flight = _in_flight(layout, rank)
    blocks = rp.blocks / layout.virtual_stages if layout.pp > 1 else rp.blocks
    # recompute and offload: estimator/recompute.py (offload_blocks counts the rank's blocks, over its chunks)
    offload = layout.offload_blocks if layout.offload_blocks == "all" else \
        min(layout.offload_blocks, rp.blocks) / (layout.virtual_stages if layout.pp > 1 else 1)

    def kept(m: Micro) -> dict:
        return stage_bytes(c, m, blocks, rp.has_embedding, rp.has_head, layout.checkpointing, flight,
                           layout.recompute_ops, offload)
    act = kept(micro)
    what = KEPT_UNDER[layout.checkpointing]
    note = f"{what}, {flight} micro-batch(es) in flight" if layout.pp > 1 else what
    if transformers_blocks:
        note += "; transformers blocks priced as a Llama block of their shape" + \
            (" with their q/k norms' inputs" if micro.qk_norm else "") + " (train.saving_forms on"
        if layout.padding_mask:
            note += "; batches with a padding attention_mask: K/V repeated to every head, each layer's mask kept)"
        else:
            more = kept(dataclasses.replace(micro, padding_mask=True))["kept"] - act["kept"]
            note += (f"; batches without an attention_mask: one with padding would add {more / 2**30:,.2f} GiB, "
                     "priced with --padding-mask)")
    items = [Item("activations", device=act["kept"], phase="backward", note=note)]
    if layout.cp > 1:    # chunks r and 2cp-1-r of c = s/(2cp) queries, against (r+1)c and (2cp-r)c keys
        chunk = layout.seq_len // (2 * layout.cp)
        items.append(Item("context-parallel mask", device=layout.dtype_bytes * chunk * chunk * (2 * layout.cp + 1),
                          note="the causal masks by global position of the rank's two chunks, shared by every "
                               "block"))
    if layout.loss_fn and layout.tp > 1 and rp.has_head:
        # the vocabulary-parallel head all-gathers the logits for a loss_fn (tensor_parallel/layers.py), which
        # keeps them until its backward; what the loss itself saves besides is the user's code
        items.append(Item("loss_fn's whole logits", device=micro.b * micro.s * c.vocab_size * micro.d,
                          phase="backward", note="gathered over tp for the loss_fn, kept until its backward; "
                                                 "what the loss saves besides is not counted"))
    if act["host"]:
        items.append(Item("offloaded activations", host=act["host"], phase="backward",
                          note=f"{layout.offload_blocks} blocks' saved activations, pinned host memory"))
    if act["recompute"] or act["loss_transient"]:
        big = max(act["recompute"], act["loss_transient"])
        again = "one block recomputed" if layout.checkpointing != "none" else "one block brought back"
        name = "logits gradients" if act["loss_transient"] >= act["recompute"] else again
        items.append(Item(name, device=big, phase="backward", note="at the start of backward"))
    if layout.pp == 1:
        return items
    msg = block_input_bytes(c, micro)     # a stage's input or output: the residual stream of one micro-batch
    items.append(Item("pipeline buffers", device=2 * msg * flight, phase="backward",
                      note="stage input and output per micro-batch in flight"))
    if on_cpu:   # the shared-memory mailbox's slots (comm/mailbox.py), touched as far as messages reach
        items.append(Item("pipeline mailbox", device=resident_bytes(layout.pp, msg),
                          note="shared-memory slots to and from the neighbouring stages"))
    return items


def _backward_buffer_items(shape: ModelShape, rp: RankParams, base: RankParams | None, layout: Layout,
                           bucket: int) -> list[Item]:
    """Beside the activations in backward: the largest weight's fresh gradient, ZeRO-3's gathered units and
    the gradient buckets being reduced."""
    words, d = ZERO_STAGES[layout.zero], layout.dtype_bytes
    ex = rp.experts         # (expert parallelism: the experts' share, reduced and sharded over their own group)
    items = []
    if not shape.bare:
        items.append(Item("weight gradient", device=max(rp.numels + (ex.numels if ex else []), default=0) * d,
                          phase="backward", note="the largest weight's fresh gradient before it is accumulated"))
    whole_schedule = layout.pp > 1 and layout.pipeline_gather == "schedule"
    if words.gathers:
        gathered = (rp.total + (base.total if base is not None else 0)) * d if whole_schedule else \
            zero3_gathered_bytes(rp, d, base)
        if ex is not None:      # a block's experts are a unit of their own, gathered with their prefetch
            gathered += ex.total * d if whole_schedule else 2 * max(ex.units, default=0) * d
        items.append(Item("ZeRO-3 gathered", device=gathered, phase="backward",
                          note="the stage's weights, gathered for the whole schedule" if whole_schedule
                          else "root unit + a block and its prefetch"))
    if layout.pp > 1 and layout.zero >= 2:
        items.append(Item("schedule gradients", device=(rp.total + (ex.total if ex else 0)) * d, phase="backward",
                          note="a pipeline accumulates whole gradients through its schedule and reduces them "
                               "once after it (zero/strategy.py)"))
    if words.buckets is not None:
        buckets = gradient_bucket_bytes(rp, layout.shard_ranks, layout.zero, d, bucket)
        if ex is not None:
            buckets += gradient_bucket_bytes(ex, layout.expert_shard_ranks, layout.zero, d, bucket)
        items.append(Item("gradient buckets", device=buckets, phase="backward", note=words.buckets))
    return items


def _step_items(shape: ModelShape, rp: RankParams, st: dict, layout: Layout, zero: dict,
                on_cpu: bool) -> list[Item]:
    """What the optimizer step adds: the NVMe swap-in, ZeRO-1's fp32 gradient shard, per-tensor temporaries."""
    shard = grad_shard_elems(st, rp, layout.shard_ranks, layout.zero)
    if rp.experts is not None and layout.zero < 2:
        shard += rp.experts.total / layout.expert_shard_ranks
    items = []
    if layout.offload_optimizer == "nvme":   # read back into host memory (which is the device on a CPU run)
        swapped = nvme_swap_in_bytes(st, shard, int(zero.get("sub_group_size", 10 ** 9)))
        items.append(Item("NVMe swap-in", device=swapped if on_cpu else 0.0, host=0.0 if on_cpu else swapped,
                          phase="step", note="one sub-group's master and states read back for its step"))
    if ZERO_STAGES[layout.zero].shard_at_step:
        on_host = layout.offload_optimizer != "none" and not on_cpu
        items.append(Item("fp32 gradient shard", device=0.0 if on_host else shard * 4,
                          host=shard * 4 if on_host else 0.0, phase="step", note="from the reduce to the step"))
    if on_cpu and not shape.bare and layout.optimizer.lower() in ("adamw", "adam"):
        # the largest tensor (or piece of the shard) stepped at once
        biggest = max(rp.numels + (rp.experts.numels if rp.experts else []), default=0)
        largest = biggest if layout.zero == 0 else min(biggest, shard)
        items.append(Item("optimizer temporaries", device=2 * 4 * largest, phase="step",
                          note="per-tensor AdamW on CPU"))
    return items


def _peak(items: list[Item]) -> float:
    s = {p: sum(i.device for i in items if i.phase == p) for p in ("always", "backward", "step")}
    return s["always"] + max(s["backward"], s["step"])


def estimate_layout(model, layout: Layout, *, nodes: int = 1, gpu_memory: float | None = None,
                    device_type: str = "cuda", runtime_bytes: float | None = None, zero: dict | None = None,
                    optimizer_params: dict | None = None, partition: str = "uniform",
                    ranks: list[RankParams] | None = None, lora=None) -> Estimate:
    """Estimate for a Layout (the planner's entry point; it passes `ranks` cached per tp x pp). `lora`: a config
    lora section (enabled, r, target_modules): only the adapters train."""
    shape = load_shape(model)
    if layout.gpus % nodes:
        raise ValueError(f"{layout.gpus} GPUs do not split evenly over {nodes} nodes; use a multiple of {nodes}")
    runtime = runtime_bytes if runtime_bytes is not None else (
        CPU_RUNTIME_BYTES if device_type == "cpu" else CUDA_RUNTIME_BYTES)
    bases = None
    if lora is not None and lora.enabled:
        if layout.ep > 1:
            raise ValueError(f"LoRA under expert parallelism (ep {layout.ep}) is not priced; estimate with ep 1")
        ranks, bases = lora_rank_params(shape, lora, layout.tp, layout.pp, layout.virtual_stages, partition)
    else:
        ranks = ranks or rank_params(shape, layout.tp, layout.pp, layout.virtual_stages, partition, ep=layout.ep)
        if shape.n_frozen:      # (a frozen encoder) held as weights beside the trained ones, like LoRA's base
            bases = rank_params(shape, layout.tp, layout.pp, layout.virtual_stages, partition, trainable=False)
    priced = [_rank_items(shape, rp, r, layout, device_type, runtime, zero or {}, optimizer_params or {},
                          bases[r] if bases else None) for r, rp in enumerate(ranks)]
    peaks = [_peak(items) for items, _ in priced]
    worst = max(range(len(peaks)), key=peaks.__getitem__)
    items, st = priced[worst]
    return Estimate(shape.name, shape.n_params, layout, nodes, device_type, gpu_memory, items, worst, st, peaks,
                    [s for _, s in priced], shape, ranks, bases)


def estimate(model, config=None, *, gpus: int | None = None, nodes: int = 1, gpu_memory: float | None = None,
             device_type: str | None = None, runtime_bytes: float | None = None, loss_fn: bool = False,
             padding_mask: bool = False) -> Estimate:
    """Memory per GPU for `model` (preset name, config.json, LlamaConfig or meta nn.Module) under `config`
    (dict, path or bunsan.Config) on `gpus` processes (default: the config's tp x pp x cp). `loss_fn`: the
    engine is given one (bunsan.initialize(..., loss_fn=...)), which gets whole logits under tensor parallelism.
    `padding_mask`: the batches carry an attention_mask with padding (a transformers model's blocks then keep
    more: activations.Micro); `bunsan train`'s rows are right-padded and causal, with none."""
    from bunsan.config.root import Config
    cfg = Config.load(config)
    world = gpus or cfg.tensor_parallel.size * cfg.pipeline.stages * cfg.context_parallel.size
    layout = Layout.from_config(cfg, world).replace(loss_fn=loss_fn, padding_mask=padding_mask)
    if device_type is None:
        device_type = "cuda"
    if not cfg.train.saving_forms:     # a transformers model's blocks then save what transformers saves
        model = dataclasses.replace(load_shape(model), blocks_as=None)
    if cfg.tensor_parallel.encoders != "split":     # a composite model's towers kept whole on every rank
        model = dataclasses.replace(load_shape(model), tp_encoders=cfg.tensor_parallel.encoders)
    return estimate_layout(model, layout, nodes=nodes, gpu_memory=gpu_memory, device_type=device_type,
                           runtime_bytes=runtime_bytes, zero=cfg.zero_optimization.model_dump(),
                           optimizer_params=cfg.optimizer.params, partition=cfg.pipeline.partition,
                           lora=cfg.lora)
