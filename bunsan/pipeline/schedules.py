"""Pipeline-parallel schedules as plain data: build, check, simulate, render.

A schedule is `list[list[Action]]`: one ordered action list per pipeline rank.
Global stage s = chunk * p + rank (stages 0..p*v-1). Stage 0 embeds (no
recv_fwd, no send_bwd); the last stage computes the loss (no send_fwd, no
recv_bwd). Every compute action is wrapped as [recv] compute [send], so a
runtime can execute the lists literally and the same lists can be checked and
simulated without torch.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Union

from bunsan.pipeline import p2p_rules
from bunsan.pipeline.p2p_rules import COMPUTE, KINDS
from bunsan.pipeline.simulation import SimResult, simulate  # noqa: F401  (schedules' public API: check() runs it)
SCHEDULES = ("gpipe", "1f1b", "interleaved")
_SHORT = {"recv_fwd": "rF", "forward": "F", "send_fwd": "sF",
          "recv_bwd": "rB", "backward": "B", "send_bwd": "sB"}
# compute kind -> (its recv, its send)
_WRAP = {"forward": ("recv_fwd", "send_fwd"), "backward": ("recv_bwd", "send_bwd")}


@dataclass(frozen=True)
class Action:
    kind: str   # one of KINDS
    micro: int  # micro-batch index, 0..m-1
    chunk: int = 0  # virtual chunk on this rank, 0..v-1

    def label(self, with_chunk: bool) -> str:
        text = f"{_SHORT[self.kind]}{self.micro}"
        return f"{text}.{self.chunk}" if with_chunk else text

    def __str__(self) -> str:
        return self.label(self.chunk != 0)


Schedule = list  # list[list[Action]], one list per rank


# ---------------------------------------------------------------- building

def _validate(p: int, m: int, v: int) -> None:
    for what, val in (("pipeline stages p", p), ("micro-batches m", m), ("virtual chunks v", v)):
        if not isinstance(val, int) or isinstance(val, bool) or val < 1:
            raise ValueError(f"{what} must be a positive integer, got {val!r}")


def wrap_with_p2p(compute: list, rank: int, p: int, v: int, slots: list | None = None) -> list:
    """Put each compute between the recv that feeds it and the send that hands its result on. With `slots`
    (lists of computes, in order), the computes of a slot run back to back: their recvs come before the slot
    and their sends after it, so the sends of one slot and the recvs of the next are one batch (p2p_rules.py)."""
    last = p * v - 1

    def comm(a: Action):
        stage = a.chunk * p + rank
        has_recv, has_send = (stage > 0, stage < last) if a.kind == "forward" else (stage < last, stage > 0)
        recv, send = _WRAP[a.kind]
        return ([Action(recv, a.micro, a.chunk)] if has_recv else []), ([Action(send, a.micro, a.chunk)]
                                                                         if has_send else [])
    out = []
    for slot in slots if slots is not None else [[a] for a in compute]:
        parts = [comm(a) for a in slot]
        out += [r for rs, _ in parts for r in rs] + list(slot) + [x for _, ss in parts for x in ss]
    return out


def _megatron_slots(order: list, warmup: int) -> list:
    """Megatron's interleaved grouping of a pipedream_order list: each warm-up forward alone, then the
    (forward, backward) pairs, then each remaining backward alone. Under NCCL a send must find its receive posted
    (p2p_rules.py): with one batch per pair (send-forward, send-backward, recv-forward, recv-backward) the
    interleaved schedule cannot deadlock, where one batch between each two computes does (a rank's lone
    send-backward waits for a peer that waits for it)."""
    steady = len(order) // 2 - warmup                # forward/backward pairs
    head = [[a] for a in order[:warmup]]
    pairs = [order[warmup + 2 * k:warmup + 2 * k + 2] for k in range(steady)]
    return head + pairs + [[a] for a in order[warmup + 2 * steady:]]


def pipedream_order(n: int, warmup: int, fwd: Callable[[int], Action], bwd: Callable[[int], Action]) -> list:
    """`warmup` forwards, then forward/backward pairs, then the remaining backwards.

    warmup == n is GPipe (all forwards first); smaller warm-ups bound the
    activations held, since every steady-state forward is paid back by a backward.
    """
    order = [fwd(k) for k in range(warmup)]
    for k in range(n - warmup):
        order += [fwd(warmup + k), bwd(k)]
    return order + [bwd(k) for k in range(n - warmup, n)]


def _single_chunk(p: int, m: int, warmup: Callable[[int], int]) -> Schedule:
    _validate(p, m, 1)
    fwd, bwd = (lambda k: Action("forward", k)), (lambda k: Action("backward", k))
    return [wrap_with_p2p(pipedream_order(m, warmup(r), fwd, bwd), r, p, 1) for r in range(p)]


def gpipe(p: int, m: int) -> Schedule:
    """All m forwards, then all m backwards in order 0..m-1 (as torch's ScheduleGPipe)."""
    return _single_chunk(p, m, lambda r: m)


def one_f_one_b(p: int, m: int) -> Schedule:
    """PipeDream-flush: rank r warms up with min(p-r-1, m) forwards, then alternates F/B.

    p-r-1 is how many later ranks micro 0 must cross before its gradient can come
    back, so rank r never holds more than p-r activations.
    """
    return _single_chunk(p, m, lambda r: min(p - r - 1, m))


def interleaved_warmup(p: int, m: int, v: int, rank: int) -> int:
    """Megatron-LM's warm-up forward count for rank `rank` (in chunk-forwards)."""
    if v == 1:
        return min(p - rank - 1, m)  # Megatron runs plain 1F1B without virtual chunks
    if m == p:
        return m * v  # Megatron: all forwards first when there are just p micro-batches
    # (v-1)*p fills every chunk but the last. Megatron doubles 1F1B's p-r-1 because its
    # sends and receives are paired blocking exchanges; with free non-blocking sends (as in
    # simulate) p-r-1 gives the same bubble, so the extra forwards only cost activation memory.
    return min((p - rank - 1) * 2 + (v - 1) * p, m * v)


def megatron_slot(kind: str, p: int, v: int) -> Callable[[int], Action]:
    """The k-th forward (backward) on a rank: chunks rotate every p micro-batches, backwards from the last chunk."""
    def slot(k: int) -> Action:
        chunk = (k // p) % v
        micro = (k // (p * v)) * p + k % p
        return Action(kind, micro, chunk if kind == "forward" else v - 1 - chunk)
    return slot


def interleaved(p: int, m: int, v: int) -> Schedule:
    """Megatron-LM interleaved 1F1B: rank r holds chunks with stages r, r+p, ..., r+(v-1)p.

    v == 1 is plain 1F1B (as in Megatron), so m need not be a multiple of p then.
    """
    _validate(p, m, v)
    if v > 1 and m % p:
        lo, hi = (m // p) * p, -(-m // p) * p
        fix = f"{hi}" if lo == 0 else f"{lo} or {hi}"
        raise ValueError(f"interleaved schedule needs micro-batches m={m} to be a multiple of stages p={p} "
                         f"(micro-batches rotate through chunks in groups of p); "
                         f"set gradient_accumulation_steps to {fix}")
    fwd, bwd = megatron_slot("forward", p, v), megatron_slot("backward", p, v)
    out = []
    for r in range(p):
        warmup = interleaved_warmup(p, m, v, r)
        order = pipedream_order(m * v, warmup, fwd, bwd)
        out.append(wrap_with_p2p(order, r, p, v, _megatron_slots(order, warmup) if v > 1 else None))
    return out


def _check_name(name: str, v: int) -> None:
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
    if name != "interleaved" and v != 1:
        raise ValueError(f"virtual_stages v={v} needs the interleaved schedule, got schedule {name!r}; "
                         f"set pipeline.schedule to 'interleaved' or virtual_stages to 1")


def build(name: str, p: int, m: int, v: int = 1) -> Schedule:
    """The schedule `name` ("gpipe" | "1f1b" | "interleaved") for p ranks, m micro-batches, v chunks per rank."""
    _validate(p, m, v)
    _check_name(name, v)
    if m < p:  # fewer micro-batches than stages leaves ranks idle for the whole step
        raise ValueError(f"pipeline needs at least `stages` micro-batches: gradient_accumulation_steps m={m} "
                         f"< stages p={p}; raise gradient_accumulation_steps to {p}")
    if name == "gpipe":
        return gpipe(p, m)
    if name == "1f1b":
        return one_f_one_b(p, m)
    return interleaved(p, m, v)


def forward_only(p: int, m: int, v: int = 1) -> Schedule:
    """Evaluation: every micro-batch through every chunk, micro-batch by micro-batch, no backward."""
    _validate(p, m, v)
    return [wrap_with_p2p([Action("forward", k, c) for k in range(m) for c in range(v)], r, p, v) for r in range(p)]


def in_flight_bound(name: str, p: int, m: int, v: int, rank: int) -> int:
    """Most micro-batch chunks rank `rank` holds forwarded but not yet backwarded, as each schedule promises."""
    _check_name(name, v)
    if name == "gpipe":
        return m
    if name == "1f1b":
        return min(p - rank, m)
    return min(interleaved_warmup(p, m, v, rank) + 1, m * v)


# ---------------------------------------------------------------- checking

def _stage(a: Action, rank: int, p: int) -> int:
    return a.chunk * p + rank


_link = p2p_rules.link


def _check_shape(schedule: Schedule, p: int, m: int, v: int) -> None:
    if len(schedule) != p:
        raise ValueError(f"schedule has {len(schedule)} rank lists, expected p={p}")
    for rank, acts in enumerate(schedule):
        for i, a in enumerate(acts):
            if a.kind not in KINDS or not 0 <= a.micro < m or not 0 <= a.chunk < v:
                raise ValueError(f"rank {rank} action {i} {a!r}: kind must be one of {KINDS}, "
                                 f"micro in 0..{m - 1}, chunk in 0..{v - 1}")


def _check_compute_once(schedule: Schedule, p: int, m: int, v: int, kinds=COMPUTE) -> None:
    seen = Counter((a.kind, a.micro, _stage(a, r, p)) for r, acts in enumerate(schedule)
                   for a in acts if a.kind in COMPUTE)
    for kind in COMPUTE:
        if kind not in kinds:
            if any(k == kind for k, _, _ in seen):
                raise ValueError(f"a forward-only schedule has a {kind}")
            continue
        for s in range(p * v):
            for micro in range(m):
                n = seen[(kind, micro, s)]
                if n != 1:
                    what = "missing" if n == 0 else f"scheduled {n} times"
                    raise ValueError(f"{kind} of micro-batch {micro} at stage {s} (rank {s % p}, "
                                     f"chunk {s // p}) is {what}")


def _check_order(acts: list, rank: int) -> None:
    done = set()
    for a in acts:
        if a.kind == "forward":
            done.add((a.micro, a.chunk))
        elif a.kind == "backward" and (a.micro, a.chunk) not in done:
            raise ValueError(f"rank {rank}: backward {a.label(True)} comes before its forward "
                             f"{Action('forward', a.micro, a.chunk).label(True)}")


def _at(acts: list, i: int) -> Optional[Action]:
    return acts[i] if 0 <= i < len(acts) else None


def _in_slot(acts: list, i: int, target: Action, step: int, passable: str) -> bool:
    """Whether `target` is reached from acts[i] going `step` (+1 / -1), passing only `passable` communication
    (receives before a slot, sends after it) and at most one other compute (a slot holds at most two)."""
    computes, j = 0, i + step
    while 0 <= j < len(acts):
        b = acts[j]
        if b == target:
            return True
        if b.kind in COMPUTE:
            computes += 1
            if computes > 1:
                return False
        elif not b.kind.startswith(passable):
            return False
        j += step
    return False


def _check_wrapping(acts: list, rank: int, p: int, v: int) -> None:
    """Each recv comes before its compute and each send after it, in its slot (wrap_with_p2p)."""
    last = p * v - 1
    for i, a in enumerate(acts):
        if a.kind in COMPUTE:
            stage = _stage(a, rank, p)
            needs = (stage > 0, stage < last) if a.kind == "forward" else (stage < last, stage > 0)
            for need, comm, step, where in zip(needs, _WRAP[a.kind], (-1, 1), ("preceded", "followed")):
                if need and not _in_slot(acts, i, Action(comm, a.micro, a.chunk), step, comm[:4]):
                    raise ValueError(f"rank {rank}: {a.kind} {a.label(True)} at stage {stage} is not {where} by "
                                     f"its {comm} (in its slot: at most one other compute between them)")
            continue
        compute = "forward" if a.kind.endswith("fwd") else "backward"
        recv = a.kind.startswith("recv")
        if not _in_slot(acts, i, Action(compute, a.micro, a.chunk), 1 if recv else -1, a.kind[:4]):
            raise ValueError(f"rank {rank}: {a.kind} {a.label(True)} is not {'before' if recv else 'after'} its "
                             f"{compute} (in its slot: at most one other compute between them)")


def _check_links(schedule: Schedule, p: int, v: int) -> None:
    sends, recvs = Counter(), Counter()
    where = {}
    for rank, acts in enumerate(schedule):
        for a in acts:
            if a.kind not in COMPUTE:
                key = _link(a, rank, p)
                (sends if a.kind.startswith("send") else recvs)[key] += 1
                where.setdefault((key, a.kind[:4]), (rank, a))
    for key in sorted(set(sends) | set(recvs), key=str):
        if sends[key] != recvs[key]:
            direction, micro, src, dst = key
            side = "send" if sends[key] > recvs[key] else "recv"
            other = ("recv_" if side == "send" else "send_") + direction
            peer = dst if side == "send" else src
            rank, a = where[(key, side)]
            peer_text = f"rank {peer % p}" if 0 <= peer < p * v else "no rank (no such stage)"
            raise ValueError(f"rank {rank}: {a.kind} {a.label(True)} (stage {src} -> {dst}) has no matching "
                             f"{other} on {peer_text}")


def peak_in_flight(schedule: Schedule) -> list:
    """Per rank, the most (micro, chunk) pairs forwarded and not yet backwarded at any point."""
    peaks = []
    for acts in schedule:
        now = peak = 0
        for a in acts:
            now += (a.kind == "forward") - (a.kind == "backward")
            peak = max(peak, now)
        peaks.append(peak)
    return peaks


def check(schedule: Schedule, p: int, m: int, v: int = 1,
          max_in_flight: Optional[Union[int, Sequence[int]]] = None, forward_only: bool = False) -> None:
    """Raise ValueError naming the first problem: each rank's list on its own, then across ranks the order of
    the transfers between two ranks and a run under NCCL's rules (p2p_rules.py), which proves the lists free of
    deadlock on NCCL and on gloo alike (a send that waits for its receive is the stricter rule)."""
    _validate(p, m, v)
    _check_shape(schedule, p, m, v)
    _check_compute_once(schedule, p, m, v, ("forward",) if forward_only else COMPUTE)
    for rank, acts in enumerate(schedule):
        _check_order(acts, rank)
        _check_wrapping(acts, rank, p, v)
    _check_links(schedule, p, v)
    if p > 1:     # (one rank has no peer: a pipeline of one stage sends nothing)
        p2p_rules.check_order(schedule, p)
        try:
            simulate(schedule, p, v, rules="nccl", every_header=forward_only)
        except RuntimeError as e:
            raise ValueError(str(e)) from e
    if max_in_flight is not None:
        limits = [max_in_flight] * p if isinstance(max_in_flight, int) else list(max_in_flight)
        if len(limits) != p:
            raise ValueError(f"max_in_flight has {len(limits)} per-rank limits, expected p={p}")
        for rank, (peak, limit) in enumerate(zip(peak_in_flight(schedule), limits)):
            if peak > limit:
                raise ValueError(f"rank {rank} holds {peak} micro-batch chunks in flight, more than {limit}")


def theory_bubble(name: str, p: int, m: int, v: int = 1) -> float:
    """Textbook idle fraction of a step: bubble / (ideal + bubble).

    ideal = m (t_f + t_b) and bubble = (p-1)(t_f + t_b) / v (with t_f, t_b a whole
    rank's times), giving (p-1)/(m+p-1) for GPipe and 1F1B and ((p-1)/v)/(m+(p-1)/v)
    for interleaved. Megatron-LM quotes the ratio bubble / ideal instead: bubble_ratio().
    """
    _check_name(name, v)
    b = (p - 1) / v
    return b / (m + b)


def bubble_ratio(name: str, p: int, m: int, v: int = 1) -> float:
    """Bubble time over ideal time, as in Megatron-LM: (p-1)/m, or (p-1)/(v m) interleaved."""
    _check_name(name, v)
    return (p - 1) / (v * m)


def render(schedule: Schedule) -> str:
    """One line per rank listing its compute actions in order, e.g. 'rank 0: F0 F1 B0 F2 B1 ...'."""
    with_chunk = any(a.chunk for acts in schedule for a in acts)  # then label every chunk, even 0
    width = len(str(len(schedule) - 1))
    return "\n".join(f"rank {r:>{width}}: " + " ".join(a.label(with_chunk) for a in acts if a.kind in COMPUTE)
                     for r, acts in enumerate(schedule))
