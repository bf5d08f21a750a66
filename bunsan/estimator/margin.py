"""How close to a GPU's memory a layout's estimated peak may come and still be ranked: from the estimate's own
measured error, not a flat fraction.

`bunsan estimate`'s peaks were measured against 15 layouts (benchmarks/bench_estimate.py, benchmarks/RESULTS.md
"Memory estimator and planner": ZeRO 0-3, offload to CPU and NVMe, recompute, accumulation, bf16, TP, TP + SP,
PP): the measured peak was 0.935x to 1.119x the estimate. So a layout whose estimate times the highest ratio is
within memory fits; one within memory at the lowest ratio but not at the highest may fit or not, and is ranked
after the ones that fit with how far past memory it would go if the estimate errs as far as measured; one past
memory even at the lowest ratio is dropped. The ratios were measured on the CPU (no GPU has been lent): the CUDA
caching allocator's fragmentation is not in them. `--margin F` (a fraction kept free) replaces the rule with the
flat cut it names.
"""

from __future__ import annotations

from dataclasses import dataclass

GiB = 1024 ** 3
# measured peak / estimated peak, lowest and highest over the 15 layouts (2026-11-29, the 2-core CPU VM); on an
# H100 (the GPU self-check, 2026-12-05) the 1B preset's eager, eager + recompute and compiled runs measured
# 0.989-0.991, inside it
MEASURED_RATIO = (0.935, 1.119)
# The same check's compiled run with whole-block recompute (`train.compile` + activation_checkpointing) peaked at
# 1.311x the estimate (48.92 against 37.31 GiB allocated; torch 2.11's inductor keeps a larger backward working set
# than eager recompute, which the estimate prices): such a run fits only within memory / this ratio
COMPILED_RECOMPUTE_RATIO = 1.311


@dataclass(frozen=True)
class MemoryRule:
    """`flat`: a fraction of memory kept free (--margin), else the measured ratios decide."""
    low: float = MEASURED_RATIO[0]
    high: float = MEASURED_RATIO[1]
    flat: float | None = None

    @classmethod
    def of(cls, margin: float | None) -> "MemoryRule":
        if margin is None:
            return cls()
        if not 0.0 <= margin < 1.0:
            raise ValueError(f"margin {margin!r} must be a fraction of memory kept free, in [0, 1)")
        return cls(flat=margin)

    def for_run(self, compiled: bool, checkpointing) -> "MemoryRule":
        """The rule for a layout run compiled (`train.compile`) with `checkpointing` ("full" / True: whole-block
        recompute): its measured error is COMPILED_RECOMPUTE_RATIO, not MEASURED_RATIO's highest. A flat
        --margin stays the user's."""
        if self.flat is not None or not compiled or checkpointing not in (True, "full"):
            return self
        return MemoryRule(low=self.low, high=max(self.high, COMPILED_RECOMPUTE_RATIO))

    def fits(self, peak: float, memory: float | None) -> bool:
        """Within memory even if the estimate is as low as measured (or within the flat cut)."""
        if memory is None:
            return True
        return peak <= memory * (1 - self.flat) if self.flat is not None else peak * self.high <= memory

    def ranked(self, peak: float, memory: float | None) -> bool:
        """Fits, or may fit: within memory if the estimate is as high as measured."""
        if memory is None or self.flat is not None:
            return self.fits(peak, memory)
        return peak * self.low <= memory

    def verdict(self, peak: float, memory: float | None) -> str:
        """'fits', 'at risk' (ranked after those that fit, see `risk`) or 'does not fit' (dropped)."""
        return "fits" if self.fits(peak, memory) else "at risk" if self.ranked(peak, memory) else "does not fit"

    def risk(self, peak: float, memory: float | None) -> str:
        """'' for a layout that fits; else how far past memory it may go."""
        if self.fits(peak, memory) or not self.ranked(peak, memory):
            return ""
        return (f"at risk: {peak * self.high / memory - 1:+.0%} past memory if the estimate is as low as measured "
                f"(x{self.high:g}); fits if it errs by less than {memory / peak - 1:+.0%}")

    @property
    def usable_line(self) -> str:
        """What the rule keeps, for the plan's heading."""
        if self.flat is not None:
            return f"{self.flat:.0%} kept free"
        return f"peaks within memory at {self.high:g}x the estimate, ranked at risk up to {self.low:g}x"

    def usable(self, memory: float) -> float:
        """The most a peak may be estimated at and fit."""
        return memory * (1 - self.flat) if self.flat is not None else memory / self.high

    def ranked_to(self, memory: float) -> float:
        """The most a peak may be estimated at and still be ranked (at risk past `usable`); past it, dropped."""
        return self.usable(memory) if self.flat is not None else memory / self.low

    def dropped(self, memory: float) -> str:
        """Why a peak past `ranked_to` is dropped: the threshold and the rule that sets it."""
        if self.flat is not None:
            return (f"past the {self.ranked_to(memory) / GiB:.1f} GiB that fit with {self.flat:.0%} of "
                    f"{memory / GiB:.1f} GiB kept free (--margin)")
        return (f"past the {self.ranked_to(memory) / GiB:.1f} GiB the search ranks ({memory / GiB:.1f} GiB / "
                f"{self.low:g}): even if the true peak is as far below the estimate as measured (x{self.low:g}), "
                "it would not fit")

    def to_json(self) -> dict:
        return {"flat_margin": self.flat, "measured_ratio": None if self.flat is not None else [self.low, self.high]}
