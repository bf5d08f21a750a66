"""The layouts the planner walks: every one bunsan can run, or the part of them a `Space` allows.

A `Space` narrows the walk to what a given software stack could run (Megatron-LM 2021 had no sequence
parallelism and always recomputed; Megatron-DeepSpeed ran ZeRO-1 under pipeline stages), so the planner
can be asked the question the authors of a published run faced, as well as the wider one bunsan offers.

The mesh is pp x dp x cp x tp (tp innermost): tensor-parallel sizes stay inside a node, context-parallel
sizes split each row (seq_len a multiple of 2 x cp, bunsan's balanced causal split), pipeline depths take
any number of stages up to the layer count, and interleaved schedules 2 or 4 virtual stages wherever the
chunks hold a block each: uneven chunks get the extra blocks first, as the engine's uniform partition does.
A transformers model is walked over what the engine runs for it and the estimator prices (`not_searched`
names the rest, with why, and the plan prints it).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from bunsan.estimator.hf_split import pipeline_blocks, pp_refusal, split_module, tp_refusal
from bunsan.estimator.layout import RECOMPUTE, Layout
from bunsan.estimator.shape import ModelShape
from bunsan.pipeline.partition import encoder_paths
from bunsan.planner.rejected import Rejected

SCHEDULES = ("1f1b", "gpipe", "interleaved")
OFFLOADS = ("none", "cpu", "nvme")


@dataclass(frozen=True)
class Space:
    """Which options the search walks; the default is everything bunsan runs."""

    zero: tuple = (0, 1, 2, 3)
    recompute: tuple = RECOMPUTE
    sequence_parallel: tuple = (False, True)
    schedules: tuple = ("1f1b", "interleaved")    # gpipe costs 1F1B's bubble with more memory: off unless asked
    offload: tuple = ("none", "cpu", "nvme")      # optimizer and parameter offload targets tried
    pipeline_gather: tuple = ("micro_batch", "schedule")   # ZeRO-3 under pipeline stages
    micro_batches: tuple = (1, 2, 4, 8, 16, 32)
    cp: tuple | None = None     # context-parallel sizes tried (where they split seq_len); None: cp_sizes' own
    ep: tuple | None = None     # expert-parallel sizes tried (a MoE model's); None: every one ep_sizes allows
    # a layout that does not fit tries sending the fewest blocks' activations to host memory that make it fit
    activation_offload: bool = True

    def __post_init__(self) -> None:
        checks = (("zero", self.zero, (0, 1, 2, 3)), ("recompute", self.recompute, RECOMPUTE),
                  ("sequence_parallel", self.sequence_parallel, (False, True)),
                  ("schedules", self.schedules, SCHEDULES), ("offload", self.offload, OFFLOADS),
                  ("pipeline_gather", self.pipeline_gather, ("micro_batch", "schedule")))
        if not isinstance(self.activation_offload, bool):
            raise ValueError(f"Space.activation_offload {self.activation_offload!r} must be True or False")
        if self.cp is not None and not isinstance(self.cp, tuple):
            raise ValueError(f"Space.cp {self.cp!r} must be a tuple of context-parallel sizes, e.g. (1, 2, 4)")
        if self.ep is not None and (not isinstance(self.ep, tuple) or not self.ep or any(
                isinstance(e, bool) or not isinstance(e, int) or e < 1 for e in self.ep)):
            raise ValueError(f"Space.ep {self.ep!r} must be a non-empty tuple of positive ints (expert-parallel "
                             "sizes), e.g. (1, 2, 4, 8)")
        bad_cp = [c for c in self.cp or () if isinstance(c, bool) or not isinstance(c, int) or c < 1]
        if bad_cp or self.cp == ():
            raise ValueError(f"Space.cp {self.cp!r} must be a non-empty tuple of positive ints (context-parallel "
                             f"sizes); drop {bad_cp}" if bad_cp else "Space.cp is empty; allow at least (1,)")
        for name, chosen, allowed in checks:
            bad = [v for v in chosen if v not in allowed]
            if bad or not chosen:
                raise ValueError(f"Space.{name} {chosen!r} must be a non-empty selection of {allowed}; "
                                 f"drop {bad}" if bad else f"Space.{name} is empty; allow at least one of {allowed}")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def not_searched(shape: ModelShape, seq_len: int | None = None) -> dict[str, str]:
    """The layout dimensions the search leaves at 1 (or off) for this model, each with why and what to do
    instead (the plan prints them: a dimension left out silently would rank a narrower search as the whole
    one). bunsan's Llama is searched over every one. A transformers model is split as the engine splits it
    (estimator/hf_split.py) where its blocks' activations are priced (a Llama-form language model), and retried
    with blocks' activations offloaded where its step is priced at rows of `seq_len` (ModelShape.timed_as)."""
    if shape.llama is not None:
        return {}
    name, module = type(shape.module).__name__, shape.module

    def unpriced(flag: str) -> str:
        return (f"{name}'s activations are not priced (its blocks are not one of estimator/shape.py's "
                "LLAMA_FORM_BLOCKS), so layouts that split them would be ranked on weights alone; price one with "
                f"`bunsan estimate --{flag} N` (its model states as the engine splits them) and measure its "
                "activations (engine.memory_report())")
    out = {}
    tp = tp_refusal(module, llama_activations=shape.blocks_as is not None)
    if tp or shape.priced_as is None:
        out["tp"] = "tensor parallelism (tp 1 only): " + (f"{tp} (the search splits a model by its own plan)" if tp
                                                          else unpriced("tp"))
    pp = pp_refusal(module)
    if pp or shape.priced_as is None:
        out["pp"] = "pipeline parallelism (pp 1 only): " + (pp or unpriced("pp"))
    out["cp"] = ("context parallelism (cp 1 only): the engine splits the attention of bunsan's own Llama only "
                 "(parallelize.check_context_parallel); a long row of this model needs recompute, or a bunsan Llama "
                 "of its shape (bunsan.models.hf loads its weights)")
    if "tp" not in out and encoder_paths(module):        # (sequence parallelism needs tp > 1)
        out["sp"] = ("sequence parallelism: the engine refuses it for a composite model (its encoders run whole on "
                     "every tensor-parallel rank, and no sequence is cut inside it)")
    elif "tp" not in out:
        out["sp"] = ("sequence parallelism under pipeline stages (searched with pp 1 only): the engine refuses it "
                     "for a transformers model, whose later stages would build their mask and positions from a "
                     "slice of the sequence")
    if shape.priced_as is not None and (seq_len is None or shape.timed_as(seq_len) is None):
        why = shape.untimed_why(seq_len) if seq_len else "its step time is not modelled"
        out["offload_blocks"] = ("blocks' activations offloaded to host memory (activation_checkpointing."
                                 "offload_blocks): a layout too big is retried with them where the step time prices "
                                 f"their traffic, not for this model ({why}); price one with `bunsan estimate "
                                 "--offload-blocks N`")
    return out


def _sequence_parallel_runs(shape: ModelShape, pp: int) -> bool:
    """Whether the engine runs sequence parallelism for this model at `pp` stages (hf_plan.py, parallelize.py:
    a transformers model's at one stage only, and never a composite model's)."""
    return shape.llama is not None or (pp == 1 and not encoder_paths(shape.module))


def tp_sizes(shape: ModelShape, gpus_per_node: int, gpus: int, rejected: Rejected | None = None) -> list[int]:
    """Tensor-parallel sizes inside a node, to 8, that split the heads, key/value heads and MLP width (and,
    for a transformers model, every layer its plan names, as the engine splits them)."""
    sizes = [t for t in _divisors(min(gpus_per_node, gpus)) if gpus % t == 0 and t <= 8]
    skipped = not_searched(shape).get("tp")
    c = shape.priced_as
    if c is None or skipped:
        for t in (t for t in sizes if t > 1 and rejected is not None):
            rejected.add("unsearched", ("tp", t), f"tp {t}: {skipped}")
        return [1]
    out = []
    for t in sizes:
        if c.num_attention_heads % t or c.num_key_value_heads % t or c.intermediate_size % t:
            if rejected is not None:
                rejected.add("tp_heads", t, f"tp {t} against {c.num_attention_heads} heads, "
                                            f"{c.num_key_value_heads} key/value heads, MLP width {c.intermediate_size}")
            continue
        if shape.llama is None and t > 1:
            try:
                split_module(shape.module, t, shape.tp_encoders, llama_activations=shape.blocks_as is not None)
            except ValueError as e:
                if rejected is not None:
                    rejected.add("tp_engine", t, str(e))
                continue
        out.append(t)
    return out


def _offloads(zero: int, dp: int, space: Space) -> list[tuple[str, str]]:
    """(optimizer, parameter) offload pairs for a ZeRO stage: optimizer offload needs a stage, parameter
    offload stage 3 (and goes where the optimizer goes)."""
    out = [("none", "none")] if "none" in space.offload else []
    for dev in (d for d in ("cpu", "nvme") if d in space.offload and zero >= 1):
        out.append((dev, "none"))
        if zero == 3:
            out.append((dev, dev))
    if dp == 1 and zero:
        out = [o for o in out if o != ("none", "none")]   # one rank: ZeRO only to offload (ZeRO-Offload)
    return out


def _schedules(pp: int, accum: int, layers: int, space: Space) -> list[tuple[str, int]]:
    if pp == 1:
        return [("1f1b", 1)]
    out = [(s, 1) for s in ("1f1b", "gpipe") if s in space.schedules]
    if "interleaved" in space.schedules and accum % pp == 0:
        out += [("interleaved", v) for v in (2, 4) if v * pp <= layers]   # uneven chunks allowed
    return out


# Past cp 8, a context-parallel size is searched only while each rank keeps this many of the row's tokens: a
# long row needs the split, a short one would only cut its attention into small chunks
LONG_ROW_TOKENS_PER_RANK = 8192


def cp_sizes(shape: ModelShape, gpus: int, tp: int, seq_len: int, space: Space,
             rejected: Rejected | None = None) -> list[int]:
    """Context-parallel sizes that divide the GPUs left after tp and cut each row into 2 x cp equal chunks
    (bunsan's Llama attention only: other models run cp 1): the space's, else every power of two the mesh
    allows, up to 8 and beyond while each rank keeps LONG_ROW_TOKENS_PER_RANK of the row."""
    if shape.llama is None:
        return [1]
    sizes = space.cp or tuple(c for c in (2 ** i for i in range(12))
                              if c <= 8 or seq_len // c >= LONG_ROW_TOKENS_PER_RANK)
    out = []
    for c in sizes:
        if (gpus // tp) % c:
            rule, why = "cp_gpus", f"cp {c} does not divide the {gpus // tp} GPUs left after tp {tp}"
        elif c > 1 and seq_len % (2 * c):
            rule, why = "cp_seq", f"seq_len {seq_len} is not a multiple of 2 x cp {c}"
        else:
            out.append(c)
            continue
        if rejected is not None:
            rejected.add(rule, (tp, c), why)
    return out


def ep_sizes(shape: ModelShape, folded: int, space: Space, rejected: Rejected | None = None) -> list[int]:
    """Expert-parallel sizes for a MoE Llama over `folded` = dp x cp ranks: the space's (else every one) that
    divide both the folded ranks and the experts; 1 for a dense model."""
    moe = shape.llama.moe_config() if shape.llama is not None else None
    if moe is None:
        return [1]
    out = []
    for e in space.ep or _divisors(min(folded, moe.num_experts)):
        if folded % e or moe.num_experts % e:
            why = f"ep {e} does not divide " + (f"the {folded} dp x cp ranks it folds over" if folded % e
                                                else f"the {moe.num_experts} experts")
        else:
            out.append(e)
            continue
        if rejected is not None:
            rejected.add("ep", (folded, e), why)
    return out


def layouts(shape: ModelShape, gpus: int, gpus_per_node: int, seq_len: int, global_batch: int,
            precision: str, optimizer: str = "AdamW", space: Space | None = None, rejected: Rejected | None = None):
    """Every layout worth pricing in `space` (bunsan can run each one); what is ruled out is counted in
    `rejected` by the rule that ruled it out (rejected.py)."""
    space = space or Space()
    moe = shape.llama is not None and shape.llama.moe is not None
    # (selective recompute of a MoE block is not priced: estimator/recompute.py)
    recompute = tuple(r for r in space.recompute if not (moe and r == "selective")) or space.recompute
    no = rejected if rejected is not None else Rejected()
    unsearched_pp = not_searched(shape).get("pp")
    layers = shape.llama.num_hidden_layers if shape.llama else 1 if unsearched_pp else pipeline_blocks(shape.module)
    for tp, cp in ((t, c) for t in tp_sizes(shape, gpus_per_node, gpus, no)
                   for c in cp_sizes(shape, gpus, t, seq_len, space, no)):
        for pp in _divisors(gpus // (tp * cp)):
            if pp > 1 and unsearched_pp:
                no.add("unsearched", ("pp", tp, cp, pp), f"pp {pp}: {unsearched_pp}")
                continue
            if pp > layers:
                no.add("pp_layers", (tp, cp, pp), f"pp {pp} over {layers} layer(s)")
                continue
            dp = gpus // (tp * cp * pp)
            mesh = f"tp {tp}, cp {cp}, pp {pp}, dp {dp}"
            if global_batch % dp:
                no.add("batch_dp", (tp, cp, pp, dp), f"global batch {global_batch} over {mesh}")
                continue
            per_rank = global_batch // dp
            for mb in space.micro_batches:
                if per_rank % mb:
                    no.add("micro_batch", (tp, cp, pp, mb), f"micro-batch {mb} of {per_rank} rows per rank, {mesh}")
                    continue
                accum = per_rank // mb
                if pp > 1 and accum < pp:       # fewer micro-batches than stages leaves stages idle
                    no.add("pp_accum", (tp, cp, pp, dp, mb), f"{accum} micro-batch(es) of {mb} over {mesh}")
                    continue
                sps = [sp for sp in space.sequence_parallel if not sp or (tp > 1 and seq_len // cp % tp == 0
                                                                             and _sequence_parallel_runs(shape, pp))]
                schedules = _schedules(pp, accum, layers, space)
                if not sps:
                    no.add("sp", (tp, cp, pp), f"sequence parallelism only, {mesh}")
                if not schedules:
                    no.add("schedule", (tp, cp, pp, mb), f"schedules {space.schedules} with {accum} micro-batches "
                                                         f"over {mesh}")
                eps = ep_sizes(shape, dp * cp, space, no)
                for (sched, v), ckpt, zero, sp, ep in itertools.product(schedules, recompute, space.zero, sps, eps):
                    gathers = space.pipeline_gather if zero == 3 and pp > 1 else ("micro_batch",)
                    offloads = _offloads(zero, dp * cp, space)
                    if not offloads:
                        no.add("offload", (tp, cp, pp, zero), f"ZeRO-{zero} on one rank, offload {space.offload}")
                    for (off_opt, off_par), gather in itertools.product(offloads, gathers):
                        yield Layout(dp=dp, tp=tp, pp=pp, cp=cp, zero=zero, micro_batch=mb, grad_accum=accum,
                                     seq_len=seq_len, precision=precision, optimizer=optimizer,
                                     checkpointing=ckpt, sequence_parallel=sp, schedule=sched,
                                     virtual_stages=v, offload_optimizer=off_opt, offload_param=off_par,
                                     pipeline_gather=gather, ep=ep)
