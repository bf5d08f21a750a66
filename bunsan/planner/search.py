"""`bunsan.plan`: every layout of a model on some GPUs, those that fit, ranked by estimated step time.

The search walks tensor-parallel sizes inside a node, context-parallel sizes, pipeline depths
(1F1B and interleaved, uneven chunks included), ZeRO stages (under pipeline stages too),
micro-batches (the accumulation makes up the global batch), recompute (none, full, selective),
sequence parallelism and offload; a layout that does not fit is tried again with the fewest
blocks whose activations go to host memory that make it fit. Each candidate is priced in bytes
by the estimator (the same code `bunsan estimate` runs) and in seconds by cost.py; the ones that
fit by the estimate's measured error (margin.py) are ranked by step time, then those that may fit,
each with its risk. When none fits, the plan says what would.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from bunsan.estimator.estimate import Estimate, estimate_layout
from bunsan.estimator.rank_params import rank_params
from bunsan.estimator.shape import ModelShape, load_shape
from bunsan.planner.compute import check_kernel
from bunsan.planner.cost import COMPONENTS, StepTime, step_time, train_time
from bunsan.estimator.margin import MemoryRule
from bunsan.planner.rejected import PRICED, Rejected
from bunsan.estimator.hardware import GPU, Interconnect, gpu_spec, interconnect, intra_link
from bunsan.estimator.layout import Layout
from bunsan.planner.space import Space, layouts, not_searched

GiB = 1024 ** 3
PROGRESS_EVERY = 1000       # layouts priced between two calls of plan()'s `progress`


@dataclass
class Candidate:
    layout: Layout
    estimate: Estimate
    step: StepTime | None = None
    why: str = ""               # why it lost to the best (or that it is the best)
    risk: str = ""              # how far past memory it may go (margin.py); "" when it fits

    @property
    def peak(self) -> float:
        return self.estimate.peak


@dataclass
class Pricing:
    """What the search priced every layout against (the model, the GPU, its memory and links), so that any
    other layout can be priced alike (`plan --explain`)."""
    shape: ModelShape
    gpu: GPU
    memory: float
    rule: MemoryRule
    nodes: int
    per_node: int
    intra: Interconnect
    inter: Interconnect
    efficiency: float | None
    attention: str
    device_type: str
    compiled: bool = False      # torch.compile's fused element-wise ops (train.compile), else eager
    overlap: tuple = ()         # another framework's overlapped communication (cost.OVERLAPS)

    def price(self, lay: Layout) -> Candidate:
        est = estimate_layout(self.shape, lay, nodes=self.nodes, gpu_memory=self.memory, device_type=self.device_type)
        step, timed = None, self.shape.timed_as(lay.seq_len)
        if timed is not None:
            step = timed_step(self.shape, timed, lay, self.gpu, self.intra, self.inter, self.per_node,
                              self.efficiency, self.attention, self.compiled, self.overlap)
        rule = self.rule.for_run(self.compiled and self.device_type != "cpu", lay.checkpointing)
        return Candidate(lay, est, step, risk=rule.risk(est.peak, self.memory))


@dataclass
class Plan:
    model: str
    n_params: int
    gpus: int
    nodes: int
    gpu: GPU
    gpu_memory: float
    rule: MemoryRule
    ranked: list[Candidate]                       # fit, fastest first; then those at risk, fastest first
    considered: int
    too_big: int
    fit: int = 0                                  # of the layouts priced, those that fit (all, not only `ranked`)
    at_risk: int = 0                              # those that may fit (margin.py), ranked after
    smallest: Candidate | None = None             # the least memory of all candidates (when none fits)
    suggestions: list[str] = field(default_factory=list)   # what to change, when nothing is ranked
    rejected: Rejected = field(default_factory=Rejected)  # what each rule of the search left out (rejected.py)
    emptied_by: list[str] = field(default_factory=list)   # when nothing is ranked: the rules that emptied it
    total_tokens: int | None = None
    pricing: Pricing | None = None
    not_searched: dict = field(default_factory=dict)     # dimension -> why the search left it out (space.py)

    @property
    def best(self) -> Candidate | None:
        return self.ranked[0] if self.ranked else None

    def days(self, c: Candidate) -> float | None:
        if self.total_tokens is None or c.step is None:
            return None
        return train_time(c.step, c.layout, self.total_tokens) / 86400


def _why(c: Candidate, best: Candidate) -> str:
    if c is best:
        return "fastest that fits" if not c.risk else "fastest; none fits for sure (see its risk)"
    deltas = {p: getattr(c.step, p) - getattr(best.step, p) for p in COMPONENTS}
    worst = max(deltas, key=deltas.get)
    slower = c.step.total / best.step.total - 1
    if deltas[worst] <= 1e-9 * best.step.total:
        return "same estimated time; ranked by ZeRO stage, offload, micro-batch, memory"
    label = {"compute": "compute", "recompute": "recomputation", "tp_comm": "tensor-parallel traffic",
             "dp_comm": "exposed data-parallel traffic", "pp_comm": "pipeline sends", "bubble": "pipeline bubble",
             "offload": "offload traffic", "optimizer": "optimizer step",
             "cp_comm": "context-parallel K/V traffic"}[worst]
    return f"{slower:+.0%}: more {label} (+{deltas[worst]:.3g} s)"


def plan(model, gpus: int, gpu_memory: float | None = None, *, gpu: str | GPU = "h100", nodes: int = 1,
         seq_len: int | None = None, global_batch: int | None = None,
         interconnect_name: str | Interconnect | None = None, inter_node: str | Interconnect = "infiniband",
         precision: str | None = None, optimizer: str = "AdamW", margin: float | None = None,
         total_tokens: int | None = None, efficiency: float | None = None, device_type: str = "cuda",
         keep: int = 10, host_memory: float | None = None, attention: str = "flash",
         space: Space | None = None, compiled: bool = False, overlap: tuple = (),
         progress: Callable[[int, int], None] | None = None) -> Plan:
    """The layouts of `model` on `gpus` GPUs (`nodes` nodes) that fit, fastest first. `host_memory` (per
    node), when given, also rules out layouts whose offloaded states would not fit in host memory. GPUs and
    links are names (hardware.py) or GPU / Interconnect objects (measured figures, `with_link`);
    `keep` 0 keeps every layout that fits. `margin`: a fraction of memory kept free, else (None) the estimate's
    measured error decides (margin.py). `compiled`: price torch.compile's fused element-wise ops (the run sets
    train.compile), else eager PyTorch's (bunsan's default). `overlap`: price another framework's overlapped
    communication (cost.OVERLAPS: a published run's), which bunsan's engine does not run. `progress`, when
    given, is called with the layouts priced so far and how many fit, every PROGRESS_EVERY layouts (a search of
    tens of thousands takes a minute: `bunsan plan` shows it)."""
    rule = MemoryRule.of(margin)
    shape = load_shape(model)
    if shape.bare:      # a plan has a sequence and a batch: the assumed Llama shape's activations count too
        shape = dataclasses.replace(shape, bare=False)
    _check_gpus(gpus, nodes)
    spec = gpu if isinstance(gpu, GPU) else gpu_spec(gpu)
    check_kernel(attention, spec)       # before the search: one clear error, not one per layout
    memory = float(gpu_memory if gpu_memory is not None else spec.memory_bytes)
    precisions = _precisions(spec, precision)
    space = _searched(space or Space(), host_memory)
    seq = seq_len or min(_longest_row(shape) or 2048, 4096)
    c = shape.timed_as(seq)         # the Llama shape its step time is priced as (None: ranked by memory)
    batch = global_batch or max(gpus, 8)
    per_node = gpus // nodes
    intra, inter = _links(spec, interconnect_name, inter_node, device_type)
    ranks = functools.lru_cache(maxsize=None)(lambda tp, pp, v, ep=1: rank_params(shape, tp, pp, v, ep=ep))

    def host_ok(e: Estimate) -> bool:
        return host_memory is None or e.host_per_node <= host_memory

    fits, considered, too_big, smallest, rejected = [], 0, 0, None, Rejected()
    candidates = itertools.chain.from_iterable(layouts(shape, gpus, per_node, seq, batch, p, optimizer, space,
                                                       rejected) for p in precisions)
    for lay in candidates:
        considered += 1
        if progress is not None and considered % PROGRESS_EVERY == 0:
            progress(considered, len(fits))
        est = estimate_layout(shape, lay, nodes=nodes, gpu_memory=memory, device_type=device_type,
                              ranks=ranks(lay.tp, lay.pp, lay.virtual_stages, lay.ep))
        # compiled recompute has its own measured error (on CUDA)
        lay_rule = rule.for_run(compiled and device_type != "cpu", lay.checkpointing)
        if not lay_rule.fits(est.peak, memory) and device_type != "cpu" and space.activation_offload:
            # offload the activations of the blocks that do not fit
            lay, est = _offload_what_does_not_fit(shape, lay, est, lay_rule, lambda offloaded: estimate_layout(
                shape, offloaded, nodes=nodes, gpu_memory=memory, device_type=device_type,
                ranks=ranks(lay.tp, lay.pp, lay.virtual_stages, lay.ep)))
        cand = Candidate(lay, est, risk=lay_rule.risk(est.peak, memory))
        if host_ok(est) and (smallest is None or est.peak < smallest.peak):
            smallest = cand
        if not lay_rule.ranked(est.peak, memory) or not host_ok(est):
            too_big += 1
            if not lay_rule.ranked(est.peak, memory):
                rejected.add("memory", example=f"{lay.describe()} peaks at {est.peak / GiB:.1f} GiB, "
                                               f"{lay_rule.dropped(memory)}")
            else:
                rejected.add("host_memory", example=f"{lay.describe()} keeps {est.host_per_node / GiB:,.0f} GiB "
                                                    f"per node in host memory, against {host_memory / GiB:,.1f} GiB")
            continue
        if c is not None:
            cand.step = timed_step(shape, c, lay, spec, intra, inter, per_node, efficiency, attention, compiled,
                                   overlap)
        fits.append(cand)
    fits.sort(key=_order)
    result = Plan(shape.name, shape.n_params, gpus, nodes, spec, memory, rule, fits[:keep or None], considered,
                  too_big, sum(not c.risk for c in fits), sum(bool(c.risk) for c in fits), smallest,
                  total_tokens=total_tokens, rejected=rejected,
                  pricing=Pricing(shape, spec, memory, rule, nodes, per_node, intra, inter, efficiency, attention,
                                  device_type, compiled, overlap), not_searched=not_searched(shape, seq))
    for cand in result.ranked:
        cand.why = _why(cand, result.ranked[0]) if cand.step else "fits"
    if not fits and not considered:       # the walk ruled every layout out: what ruled them out, not memory
        result.emptied_by = ["no layout to price: the search's rules ruled out every one before its memory was "
                             "estimated", *rejected.lines()]
        fixes = rejected.fixes(gpus=gpus, seq_len=seq, global_batch=batch, cp_asked=space.cp)
        result.suggestions = fixes + _narrowed(space, said=("cp",) if rejected.counts["cp_gpus"] else ())
    elif not fits:
        result.emptied_by = [f"memory: every one of the {considered} layouts priced was dropped",
                             *rejected.lines(PRICED)]
        result.suggestions = _narrowed(space) + _what_would_fit(
            shape, gpus, nodes, memory, rule, seq, batch, precisions[0], smallest, device_type, host_ok, host_memory,
            ranks)
    return result


def timed_step(shape: ModelShape, timed, lay: Layout, *args) -> StepTime:
    """cost.step_time of `lay` for the Llama shape `timed` (shape.timed_as); a transformers model's step says
    that it is priced as that Llama's."""
    step = step_time(timed, lay, *args, qk_norm=shape.qk_norm)
    if shape.llama is None:
        note = (f"{type(shape.module).__name__} priced as bunsan's Llama of its shape: the same GEMMs and attention, "
                "its element-wise ops as the Llama block's" + ("; its q/k norms' passes not priced (their saved "
                                                               "inputs are)" if shape.qk_norm else "")
                + " (benchmarks/bench_hf_blocks.py measures the two)")
        step = dataclasses.replace(step, assumptions=step.assumptions + (note,))
    return step


def _longest_row(shape: ModelShape) -> int | None:
    """The model's own longest sequence (a transformers config's, GPT-2's n_positions too), if it says one."""
    if shape.priced_as is not None:
        return shape.priced_as.max_position_embeddings
    config = getattr(shape.module, "config", None)
    text = config.get_text_config() if callable(getattr(config, "get_text_config", None)) else config
    longest = getattr(text, "max_position_embeddings", None)
    return longest if isinstance(longest, int) and longest > 0 else None


def _narrowed(space: Space, said: tuple = ()) -> list[str]:
    """The options the caller narrowed the search to, when they may be what left nothing (but those a fix
    has `said` already). Offload aside: NVMe is left out without a host memory (_searched). Precision aside:
    one asked for is the run's own (the doctor passes its run's), not a narrowing to undo."""
    wide, flags = Space(), {"zero": "--zero-stages", "recompute": "--recompute", "sequence_parallel": "--no-sp",
                            "cp": "--cp-sizes", "micro_batches": "Space.micro_batches", "schedules": "Space.schedules",
                            "pipeline_gather": "Space.pipeline_gather", "activation_offload": "--no-activation-offload"}
    narrowed = [flag if name in ("sequence_parallel", "activation_offload") else
                f"{flag} {','.join(map(str, getattr(space, name)))}"
                for name, flag in flags.items() if getattr(space, name) != getattr(wide, name) and name not in said]
    return [f"the search was narrowed ({'; '.join(narrowed)}): drop those options to search every layout"] \
        if narrowed else []


def _check_gpus(gpus: int, nodes: int) -> None:
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise ValueError(f"gpus must be a positive int, got {gpus!r}")
    if nodes < 1 or gpus % nodes:
        raise ValueError(f"{gpus} GPUs cannot be spread evenly over {nodes} nodes; use a multiple of {nodes}")


def _searched(space: Space, host_memory: float | None) -> Space:
    """NVMe offload holds what CPU offload holds on the GPU, only slower: it wins only where host memory
    runs out, which without a `host_memory` it cannot; leave it out then."""
    if host_memory is not None or "nvme" not in space.offload:
        return space
    return dataclasses.replace(space, offload=tuple(o for o in space.offload if o != "nvme") or ("none",))


def _precisions(spec: GPU, precision: str | None) -> list[str]:
    """16-bit (bf16 where the GPU has it) and fp32 unless one is asked for; CPUs: fp32, faster there."""
    if precision is None:
        half = "bf16" if "bf16" in spec.peak_flops else "fp16"
        return ["fp32"] if spec.name == "cpu" else [half, "fp32"]
    spec.flops(precision)                   # a precision the GPU lacks is an error here
    return [precision]


def _order(k: Candidate) -> tuple:
    """Those that fit first, then those at risk; fastest first; ties on time go to less traffic (lower ZeRO
    stage, no offload), then bigger micro-batches, then less memory."""
    return (bool(k.risk), round(k.step.total, 9) if k.step else 0.0, k.layout.zero, k.layout.offload_optimizer != "none",
            -k.layout.micro_batch, k.peak)


def _links(spec: GPU, intra, inter, device_type: str) -> tuple[Interconnect, Interconnect]:
    """(inside a node, between nodes): names or Interconnects; inside defaults to the GPU's own link."""
    def link(x):
        return x if isinstance(x, Interconnect) else interconnect(x)
    inside = link(intra) if intra else intra_link(spec) if device_type == "cuda" else interconnect("loopback")
    return inside, link(inter)


def _offload_what_does_not_fit(shape: ModelShape, lay: Layout, est: Estimate, rule: MemoryRule,
                               price) -> tuple[Layout, Estimate]:
    """The layout with the fewest blocks per rank whose activations go to host memory that makes it fit
    (`price` estimates a layout); `lay` itself when even offloading every block does not."""
    timed = shape.timed_as(lay.seq_len)
    if timed is None:       # the offload's traffic is priced in the step time only (space.not_searched says so)
        return lay, est
    if not rule.fits(est.peak_without_backward, est.gpu_memory):   # states alone too big: no count would fit
        return lay, est
    blocks = -(-timed.num_hidden_layers // lay.pp)
    every = price(lay.replace(offload_blocks=blocks))
    if not rule.fits(every.peak, every.gpu_memory):
        return lay, est
    low, high, best = 1, blocks, every          # peak falls as blocks are offloaded: bisect the count
    # about linearly: first try the count that line puts at memory's edge and its neighbour below (or above), which
    # most often settles it in two estimates; the bisection below finishes what they leave (its answer either way)
    drop = est.peak - every.peak
    guess = min(blocks, max(1, math.ceil(blocks * (est.peak - rule.usable(every.gpu_memory)) / drop))) \
        if drop > 0 else blocks
    for count in (guess, guess - 1, guess + 1):
        if low <= count < high:
            e = price(lay.replace(offload_blocks=count))
            if rule.fits(e.peak, e.gpu_memory):
                high, best = count, e
            else:
                low = count + 1
    while low < high:
        mid = (low + high) // 2
        e = price(lay.replace(offload_blocks=mid))
        if rule.fits(e.peak, e.gpu_memory):
            high, best = mid, e
        else:
            low = mid + 1
    return best.layout, best


def _what_would_fit(shape, gpus, nodes, memory, rule: MemoryRule, seq, batch, precision, smallest, device_type,
                    host_ok, host_memory, ranks) -> list[str]:
    """`ranks(tp, pp, v)`: the search's cache of rank_params (cutting a 70B model up for each of the thousands
    of layouts priced here took minutes)."""
    def ok(e: Estimate) -> bool:
        return rule.fits(e.peak, e.gpu_memory) and host_ok(e)

    def priced(lay: Layout, nodes: int) -> Estimate:
        return estimate_layout(shape, lay, nodes=nodes, gpu_memory=memory, device_type=device_type,
                               ranks=ranks(lay.tp, lay.pp, lay.virtual_stages, lay.ep))

    out = []
    if smallest is None and host_memory is not None:
        out.append(f"every layout needs more than the {host_memory / GiB:.0f} GiB of host memory per node given")
    if smallest is not None:
        out.append(f"the leanest layout, {smallest.layout.describe()}, peaks at {smallest.peak / GiB:.1f} GiB "
                   f"per GPU against {rule.usable(memory) / GiB:.1f} GiB usable ({rule.usable_line})")
        lay = smallest.layout
        if batch % gpus == 0:
            nvme = Layout(dp=gpus, zero=3, micro_batch=1, grad_accum=batch // gpus, seq_len=seq, precision=precision,
                          checkpointing=True, offload_optimizer="nvme", offload_param="nvme")
            e = priced(nvme, nodes)
            if ok(e):
                out.append(f"offload optimizer states and parameters to NVMe: {nvme.describe()} peaks at "
                           f"{e.peak / GiB:.1f} GiB and puts {e.disk_per_node / GiB:,.0f} GiB on each node's "
                           "NVMe (set offload_*.nvme_path to a local drive)")
        per_node = gpus // nodes
        for factor in (2, 4, 8, 16, 32, 64):
            lean = None
            for more in layouts(shape, gpus * factor, per_node, seq, batch * factor, precision):
                if more.micro_batch == 1 and more.checkpointing == "full":
                    e = priced(more, nodes * factor)
                    if host_ok(e) and (lean is None or e.peak < lean.peak):
                        lean = e
            if lean is not None and ok(lean):
                out.append(f"{gpus * factor} GPUs (global batch {batch * factor}): {lean.layout.describe()} "
                           f"peaks at {lean.peak / GiB:.1f} GiB")
                break
        if seq > 256:
            short = lay.replace(seq_len=seq // 2)
            e = priced(short, nodes)
            if ok(e):
                out.append(f"sequence length {seq // 2}: {short.describe()} peaks at {e.peak / GiB:.1f} GiB")
    if shape.llama is not None:
        # LoRA: frozen 16-bit weights, no gradients or optimizer states for them (adapters are ~0.1-1%).
        frozen = shape.n_params * 2
        split = f", {frozen / gpus / GiB:.1f} GiB each split {gpus} ways" if gpus > 1 else ""
        out.append(f"LoRA fine-tuning (bunsan issue #8) keeps the {shape.n_params / 1e9:.1f}B weights frozen in "
                   f"16-bit: {frozen / GiB:.1f} GiB of weights on one GPU{split}, plus activations and the small "
                   "adapters' states")
    return out
