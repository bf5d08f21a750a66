"""`plan --explain LAYOUT`: a layout you have in mind (a published run's, your own) priced exactly as the search
priced its first choice, and the two compared term by term: each step-time component, tokens/s, MFU, the
peak memory against what fits (margin.py), and the term that decides between them.

    tp=8,pp=4,cp=1,zero=1,mb=1,recompute=selective,sp=true,schedule=interleaved,v=2

Unnamed fields come from the first choice (sequence, global batch, precision, optimizer); dp is what the GPUs
leave, and the accumulation what the global batch leaves.
"""

from __future__ import annotations

from dataclasses import dataclass

from bunsan.estimator.layout import Layout
from bunsan.planner.cost import COMPONENTS
from bunsan.estimator.margin import MemoryRule
from bunsan.planner.search import Candidate, Plan

GiB = 1024 ** 3
ALIASES = {"mb": "micro_batch", "micro_batch": "micro_batch", "ga": "grad_accum", "grad_accum": "grad_accum",
           "recompute": "checkpointing", "ckpt": "checkpointing", "sp": "sequence_parallel", "v": "virtual_stages",
           "virtual_stages": "virtual_stages", "seq": "seq_len", "seq_len": "seq_len",
           **{k: k for k in ("dp", "tp", "pp", "cp", "zero", "precision", "optimizer", "schedule",
                             "offload_optimizer", "offload_param", "offload_blocks", "pipeline_gather")}}
INTS = {"dp", "tp", "pp", "cp", "zero", "micro_batch", "grad_accum", "virtual_stages", "seq_len"}
TRUE, FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def parse_layout(text: str, plan: Plan) -> Layout:
    """The layout `text` names, completed from the plan (see the module's docstring)."""
    best = plan.best.layout if plan.best else None
    fields: dict = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        name = ALIASES.get(key.strip().lower())
        if not sep or name is None:
            raise ValueError(f"--explain {item!r}: expected KEY=VALUE with KEY one of {sorted(ALIASES)}")
        value = value.strip()
        if name in INTS:
            try:
                fields[name] = int(value)
            except ValueError:
                raise ValueError(f"--explain {key}={value!r}: a whole number") from None
        elif name == "sequence_parallel":
            if value.lower() not in TRUE + FALSE:
                raise ValueError(f"--explain sp={value!r}: true or false")
            fields[name] = value.lower() in TRUE
        elif name == "checkpointing":
            fields[name] = {"none": "none", "full": "full", "selective": "selective"}.get(value.lower(), value)
        else:
            fields[name] = int(value) if name == "offload_blocks" and value.isdigit() else value
    if best is not None:
        for name in ("seq_len", "precision", "optimizer"):
            fields.setdefault(name, getattr(best, name))
    split = fields.get("tp", 1) * fields.get("pp", 1) * fields.get("cp", 1)
    if plan.gpus % split:
        raise ValueError(f"--explain: tp x pp x cp = {split} does not divide the {plan.gpus} GPUs")
    fields.setdefault("dp", plan.gpus // split)
    if fields["dp"] * split != plan.gpus:
        raise ValueError(f"--explain: dp {fields['dp']} x tp x pp x cp {split} is not the {plan.gpus} GPUs")
    batch = best.global_batch if best is not None else None
    if "grad_accum" not in fields and batch is not None:
        per_rank = fields["dp"] * fields.get("micro_batch", 1)
        if batch % per_rank:
            raise ValueError(f"--explain: the global batch {batch} is not a multiple of dp x mb = {per_rank}")
        fields["grad_accum"] = batch // per_rank
    if fields.get("virtual_stages", 1) > 1:
        fields.setdefault("schedule", "interleaved")
    return Layout(**fields)


@dataclass
class Comparison:
    best: Candidate
    asked: Candidate
    memory: float
    rule: MemoryRule

    def rows(self) -> list[tuple[str, float, float]]:
        """(term, first choice, asked) in seconds per step."""
        return [(name, getattr(self.best.step, name), getattr(self.asked.step, name)) for name in COMPONENTS]

    def decided_by(self) -> str:
        if not self.rule.ranked(self.asked.peak, self.memory):
            return (f"memory: it peaks at {self.asked.peak / GiB:.1f} GiB per GPU, "
                    f"{self.rule.dropped(self.memory)}; so the search drops it")
        if self.asked.risk and not self.best.risk:
            return f"memory: ranked after every layout that fits, {self.asked.risk}"
        deltas = {name: asked - best for name, best, asked in self.rows()}
        worst = max(deltas, key=lambda k: abs(deltas[k]))
        gap = self.asked.step.total / self.best.step.total - 1
        return f"{gap:+.1%} step time, most from {worst} ({deltas[worst]:+.3g} s per step)"

    def to_json(self) -> dict:
        return {"first_choice": self.best.layout.describe(), "asked": self.asked.layout.describe(),
                "terms_s": {name: {"first_choice": b, "asked": a} for name, b, a in self.rows()},
                "step_s": {"first_choice": self.best.step.total, "asked": self.asked.step.total},
                "tokens_per_s": {"first_choice": self.best.step.tokens_per_s, "asked": self.asked.step.tokens_per_s},
                "peak_bytes": {"first_choice": self.best.peak, "asked": self.asked.peak},
                "usable_bytes": self.rule.usable(self.memory), "ranked_to_bytes": self.rule.ranked_to(self.memory),
                "asked_risk": self.asked.risk or None,
                "decided_by": self.decided_by(),
                "assumptions": list(self.asked.step.assumptions)}


def explain(plan: Plan, text: str) -> Comparison:
    """`text`'s layout priced against the plan's first choice."""
    if plan.best is None or plan.pricing is None:
        raise ValueError("--explain compares with the plan's first choice: nothing fits")
    if plan.best.step is None:
        raise ValueError("--explain compares step times, and this model's is not modelled ("
                         f"{plan.pricing.shape.untimed_why(plan.best.layout.seq_len)})")
    asked = plan.pricing.price(parse_layout(text, plan))
    if asked.step is None:          # (a row longer than the model's sliding window: estimator/shape.py timed_as)
        raise ValueError(f"--explain {text}: this model's step time is not modelled at {asked.layout.seq_len} tokens "
                         f"({plan.pricing.shape.untimed_why(asked.layout.seq_len)}); name a seq within it")
    return Comparison(plan.best, asked, plan.gpu_memory,
                      plan.rule.for_run(plan.pricing.compiled and plan.pricing.device_type != "cpu",
                                        asked.layout.checkpointing))
