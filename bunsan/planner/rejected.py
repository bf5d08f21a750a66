"""Why the search left layouts out, counted by rule, so that an empty plan names what emptied it.

The walk (space.py) rules out whole meshes before any layout is priced: a tensor-parallel size that does not
divide the heads, a context-parallel size that does not divide the GPUs left after tensor parallelism or
does not cut the row into 2 x cp chunks, a global batch that is not a multiple of the data-parallel size, ...
The search (search.py) then drops priced layouts past the GPU's memory (margin.py) or the host's. Each rule
counts the distinct things it ruled out in its own unit (a (tp, cp) pair, a mesh, a micro-batch size, a
layout), once however many precisions are walked. When nothing is priced, the structural rules that fired
are what emptied the plan; when layouts were priced and none is ranked, memory did: only then do the
suggestions turn to LoRA, more GPUs or a shorter row.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

# rule -> what one count is, and what the rule asks
RULES = {
    "tp_heads": ("tensor-parallel sizes", "tp must divide the attention heads, the key/value heads and the MLP width"),
    "tp_engine": ("tensor-parallel sizes", "the engine must split every layer the model's plan names (an encoder "
                                           "tower's heads and MLP width too)"),
    "unsearched": ("meshes", "a dimension this model is not searched over (the plan's `not searched` lines say why)"),
    "cp_gpus": ("(tp, cp) pairs", "cp must divide the GPUs left after tensor parallelism"),
    "cp_seq": ("(tp, cp) pairs", "cp must cut the row into 2 x cp equal chunks (seq_len a multiple of 2 x cp)"),
    "pp_layers": ("meshes", "pp must be at most the layer count"),
    "batch_dp": ("meshes", "the global batch must be a multiple of the data-parallel size"),
    "micro_batch": ("micro-batch sizes", "the micro-batch must divide each data-parallel rank's share of the batch"),
    "pp_accum": ("micro-batch sizes", "a pipeline needs at least as many micro-batches as stages"),
    "schedule": ("micro-batch sizes", "a pipeline schedule searched must run the micro-batches"),
    "sp": ("meshes", "sequence parallelism needs tp > 1 dividing each rank's tokens"),
    "ep": ("expert-parallel sizes", "ep must divide the dp x cp ranks it folds over and the experts"),
    "offload": ("ZeRO stages", "on one data-parallel rank a ZeRO stage is searched only to offload"),
    "memory": ("layouts", "the peak must be within GPU memory (margin.py)"),
    "host_memory": ("layouts", "offloaded states must fit the host memory per node (--host-memory)"),
}
PRICED = ("memory", "host_memory")       # the rules that drop layouts after pricing them


@dataclass
class Rejected:
    counts: Counter = field(default_factory=Counter)
    examples: dict = field(default_factory=dict)         # rule -> the first thing it ruled out, said
    keys: dict = field(default_factory=dict, repr=False)  # rule -> the keys counted (a mesh's sizes, ...)

    def add(self, rule: str, key=None, example: str = "") -> None:
        """Count `key` (what was ruled out; None: count every call) against `rule`, once per key."""
        if rule not in RULES:
            raise ValueError(f"unknown rejection rule {rule!r}; one of {', '.join(RULES)}")
        if key is not None:
            seen = self.keys.setdefault(rule, set())
            if key in seen:
                return
            seen.add(key)
        self.counts[rule] += 1
        if example:
            self.examples.setdefault(rule, example)

    @property
    def structural(self) -> bool:
        """Some rule ruled out layouts before pricing."""
        return any(n for r, n in self.counts.items() if r not in PRICED)

    def lines(self, rules=None) -> list[str]:
        """One line per rule that fired (of `rules`, default all), most first: count, unit, rule, example."""
        fired = [r for r, _ in self.counts.most_common() if rules is None or r in rules]
        return [f"{self.counts[r]} {RULES[r][0]} ruled out: {RULES[r][1]}"
                + (f" (e.g. {self.examples[r]})" if r in self.examples else "") for r in fired]

    def to_json(self) -> dict:
        return {rule: {"count": n, "unit": RULES[rule][0], "rule": RULES[rule][1],
                       "example": self.examples.get(rule)} for rule, n in self.counts.most_common()}

    def fixes(self, *, gpus: int, seq_len: int, global_batch: int, cp_asked: tuple | None) -> list[str]:
        """What to change when no layout was priced, for each structural rule that fired, from the keys it
        counted: (tp, cp) for the cp rules, (tp, cp, pp, dp) for batch_dp, (tp, cp, pp, dp, mb) for pp_accum."""
        out, fired, keys = [], self.counts, self.keys
        if fired["cp_gpus"] and cp_asked:
            dividing = [c for c in (1, 2, 4, 8, 16, 32, 64) if c <= gpus and gpus % c == 0]
            out.append(f"--cp-sizes {','.join(map(str, cp_asked))}: a size must divide the {gpus} GPUs left after "
                       f"tensor parallelism; pass sizes among {','.join(map(str, dividing))}, or more --gpus")
        if fired["cp_seq"]:
            cps = sorted({cp for _, cp in keys["cp_seq"]})
            out.append(f"--seq-len {seq_len} is not a multiple of 2 x cp for cp {', '.join(map(str, cps))}; use a "
                       f"multiple of {2 * cps[-1]}, or smaller --cp-sizes")
        if fired["batch_dp"]:
            dps = sorted({k[3] for k in keys["batch_dp"]})
            out.append(f"--global-batch {global_batch} is not a multiple of the data-parallel sizes the mesh leaves "
                       f"({', '.join(map(str, dps))}); use a multiple of {dps[0]}, e.g. "
                       f"{-(-global_batch // dps[0]) * dps[0]}")
        if fired["pp_accum"]:
            dp, pp = min((k[3], k[2]) for k in keys["pp_accum"])
            out.append(f"--global-batch {global_batch} leaves a pipeline of {pp} stages (dp {dp}) fewer "
                       f"micro-batches than stages; raise it to at least dp x pp = {dp * pp}")
        for rule in ("tp_heads", "tp_engine", "pp_layers", "micro_batch", "schedule", "sp", "offload"):
            if fired[rule] and not out:
                out.append(f"widen the search: {RULES[rule][1]} ({self.examples.get(rule, '')})")
        return out
