"""What `plan --explain` and `plan --calibrate` print: the named layout against the first choice, term by
term, and each calibration run's measured step against its price before and after the fit; and what a plan of a
model other than bunsan's Llama leaves out: the dimensions not searched, the terms not priced."""

from __future__ import annotations

GiB = 1024 ** 3


def print_comparison(console, comparison) -> None:
    from rich.table import Table
    best, asked = comparison.best, comparison.asked
    # a heading line, not the table's title: rich wraps a title to the table's width
    console.print(f"--explain: {asked.layout.describe()} against the first choice {best.layout.describe()}",
                  highlight=False)
    table = Table()
    for col in ("term", "first choice s", "asked s", "difference s"):
        table.add_column(col, justify="left" if col == "term" else "right")
    for name, b, a in comparison.rows():
        table.add_row(name, f"{b:.4g}", f"{a:.4g}", f"{a - b:+.3g}")
    table.add_row("step", f"{best.step.total:.4g}", f"{asked.step.total:.4g}",
                  f"{asked.step.total - best.step.total:+.3g}")
    table.add_row("tokens/s", f"{best.step.tokens_per_s:,.0f}", f"{asked.step.tokens_per_s:,.0f}", "")
    table.add_row("MFU", f"{best.step.mfu:.1%}", f"{asked.step.mfu:.1%}", "")
    rule, memory = comparison.rule, comparison.memory
    table.add_row("peak GiB", f"{best.peak / GiB:.1f}", f"{asked.peak / GiB:.1f}",
                  f"fits to {rule.usable(memory) / GiB:.1f}")
    console.print(table)
    console.print(f"decided by {comparison.decided_by()}")


def runs_after(result, runs) -> list[float]:
    """Each calibration run's step time priced with the fitted constants."""
    from bunsan.planner.explain import parse_layout
    return [result.pricing.price(parse_layout(r.layout, result)).step.total for r in runs]


def print_calibration(console, calibration, after: list[float]) -> None:
    from rich.table import Table
    table = Table(title=f"--calibrate: compute x{calibration.compute_scale:.3f} (GEMM efficiency "
                        f"{calibration.efficiency:.3f}), links x{calibration.comm_scale:.3f}")
    for col in ("layout", "measured s", "priced before s", "error before", "priced after s", "error after"):
        table.add_column(col, justify="left" if col == "layout" else "right")
    for (text, measured, before), now in zip(calibration.runs, after):
        table.add_row(text, f"{measured:.4g}", f"{before:.4g}", f"{before / measured - 1:+.1%}", f"{now:.4g}",
                      f"{now / measured - 1:+.1%}")
    console.print(table)


def print_not_searched(console, result) -> None:
    """The layout dimensions the search left out for this model (planner/space.py's not_searched), each with
    why: the ranking is of the layouts searched, and a reader must not take it for the whole space."""
    if not result.not_searched:
        return
    console.print("not searched for this model (the ranking is of the rest):", highlight=False)
    for dim, why in result.not_searched.items():
        console.print(f"  - {dim}: {why}", highlight=False)


def unmodelled_line(result) -> str:
    """The closing line of a plan whose step time is not modelled (estimator/shape.py ModelShape.timed_as), saying
    what its peaks price, from the first choice's own items: the activations of the language model's blocks
    (Llama-form), or none; a composite model's encoders named as not priced."""
    est = result.ranked[0].estimate
    name = type(est.shape.module).__name__ if est.shape is not None else est.model
    unpriced = {i.name for i in est.items if i.note.startswith("NOT PRICED")}
    why = est.shape.untimed_why(est.layout.seq_len) if est.shape is not None else "it is not a Llama"
    line = (f"{name}: its step time is not modelled ({why}), so layouts are ranked by memory (ZeRO stage, offload, "
            "micro-batch, peak), not by speed; ")
    if "activations" in unpriced:
        return line + ("the peaks leave its activations out (NOT PRICED: they are floors; measure a step, "
                       "engine.memory_report())")
    said = "the peaks price its blocks' activations (each as a Llama block of its shape)"
    if "encoder activations" in unpriced:
        return line + said.replace("its blocks'", "its language model's blocks'") + \
            ", not its encoders' (NOT PRICED: the peaks are floors)"
    return line + said
