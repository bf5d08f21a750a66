"""What `plan --explain` and `plan --calibrate` print: the named layout against the first choice, term by
term, and each calibration run's measured step against its price before and after the fit."""

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
