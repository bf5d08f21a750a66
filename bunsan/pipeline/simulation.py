"""Running pipeline schedules without a model: each rank's list in order, computes taking their time and
communication free, under one of two sets of rules for the transfers:

    buffered  gloo and the shared-memory mailbox: a send never waits, a receive waits for its send
    nccl      p2p_rules.py: the transfers between two computes are one batch, which completes once every
              peer has posted its side (a send waits for its receive); headers before forward messages

The ranks are swept until none moves: an item's time is the latest of the rank's own clock and the times its
counterparts were posted, whatever order the ranks are visited in, so the sweeps give the exact timeline; a
rank that never moves again is a deadlock.
"""

from __future__ import annotations

from dataclasses import dataclass

from bunsan.pipeline import p2p_rules
from bunsan.pipeline.p2p_rules import COMPUTE, KINDS, Batch, link

DONE, POSTED, BLOCKED = "done", "posted", "blocked"   # what trying a transfer item did


@dataclass
class SimResult:
    makespan: float
    busy: list       # per-rank compute time
    intervals: list  # per rank: [(Action, start, end)] for compute actions
    bubble: float    # idle fraction: 1 - sum(busy) / (p * makespan)


def _sweep(lists: list, duration, attempt, clock: list) -> tuple[list, list, list]:
    """Run every rank's items: computes advance the rank's clock by duration(action, rank); attempt(rank, item)
    does a transfer item (DONE), or posts it without completing (POSTED), or cannot (BLOCKED).
    Returns (busy times, compute intervals, [(rank, index) of each rank left waiting])."""
    p = len(lists)
    pc, busy, intervals = [0] * p, [0.0] * p, [[] for _ in range(p)]
    progressed = True
    while progressed:
        progressed = False
        for r in range(p):
            while pc[r] < len(lists[r]):
                it = lists[r][pc[r]]
                if getattr(it, "kind", None) in COMPUTE:
                    dur = duration(it, r)
                    intervals[r].append((it, clock[r], clock[r] + dur))
                    clock[r] += dur
                    busy[r] += dur
                else:
                    outcome = attempt(r, it)
                    progressed |= outcome == POSTED
                    if outcome != DONE:
                        break
                pc[r] += 1
                progressed = True
    return busy, intervals, [(r, pc[r]) for r in range(p) if pc[r] < len(lists[r])]


def _buffered(schedule: list, p: int, clock: list):
    sent = {}  # link -> time the send happened

    def attempt(r: int, a) -> str:
        key = link(a, r, p)
        if a.kind.startswith("send"):
            sent[key] = clock[r]
        elif key in sent:
            clock[r] = max(clock[r], sent[key])
        else:
            return BLOCKED
        return DONE
    return schedule, attempt, lambda r, i: f"action {i} ({schedule[r][i].label(True)})", "pipeline schedule deadlocks"


def _nccl(schedule: list, p: int, clock: list, every_header: bool):
    headed = set().union(*(p2p_rules.header_links(acts, r, p, every_header) for r, acts in enumerate(schedule)))
    plans = [p2p_rules.plan(acts, r, p, headed) for r, acts in enumerate(schedule)]
    posted = {"send": {}, "recv": {}}        # link -> when its operation was posted
    counterpart = {"send": "recv", "recv": "send"}
    waiting = [False] * p                    # the rank has posted its current batch

    def attempt(r: int, batch: Batch) -> str:
        outcome = DONE
        if not waiting[r]:
            waiting[r] = True
            for side, key in batch.ops:
                posted[side][key] = clock[r]
            outcome = POSTED
        theirs = [posted[counterpart[side]].get(key) for side, key in batch.ops]
        if any(t is None for t in theirs):
            return outcome if outcome == POSTED else BLOCKED     # a peer has not posted its side yet
        clock[r] = max([clock[r], *theirs])
        waiting[r] = False
        return DONE
    return plans, attempt, lambda r, i: _describe(plans[r][i]), (
        "pipeline schedule deadlocks under NCCL's rules (a send waits for its receive; the transfers between "
        "two computes are one batch)")


def _describe(it) -> str:
    return it.describe() if isinstance(it, Batch) else it.label(True)


def simulate(schedule: list, p: int, v: int = 1, t_fwd=1.0, t_bwd=2.0, rules: str = "buffered",
             every_header: bool = False) -> SimResult:
    """Run each rank's list in order; computes take t_fwd / t_bwd per chunk (one number, or one per global
    stage: unequal stages, e.g. measured ones); communication is free, under the "buffered" or "nccl" rules
    (module docstring; `every_header`: a header before every forward message, as evaluation sends them).
    Raise RuntimeError on deadlock."""
    if len(schedule) != p:
        raise ValueError(f"schedule has {len(schedule)} rank lists, expected p={p}")
    for r, acts in enumerate(schedule):
        for i, a in enumerate(acts):
            if a.kind not in KINDS or not 0 <= a.chunk < v:
                raise ValueError(f"rank {r} action {i} {a!r}: unknown kind or chunk outside 0..{v - 1}")

    def duration(a, r: int) -> float:
        t = t_fwd if a.kind == "forward" else t_bwd
        return t if isinstance(t, (int, float)) else t[a.chunk * p + r]

    clock = [0.0] * p
    if rules == "nccl":
        lists, attempt, where, what = _nccl(schedule, p, clock, every_header)
    elif rules == "buffered":
        lists, attempt, where, what = _buffered(schedule, p, clock)
    else:
        raise ValueError(f"rules={rules!r}: expected 'buffered' or 'nccl'")
    busy, intervals, stuck = _sweep(lists, duration, attempt, clock)
    if stuck:
        raise RuntimeError(what + ": " + "; ".join(f"rank {r} waits at {where(r, i)}" for r, i in stuck))
    makespan = max(clock, default=0.0)
    return SimResult(makespan, busy, intervals, 1.0 - sum(busy) / (p * makespan) if makespan > 0 else 0.0)
