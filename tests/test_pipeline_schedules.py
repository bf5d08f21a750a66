"""Pipeline schedules as data: built, checked against their promises, simulated."""
import pytest

from bunsan.pipeline.schedules import (
    Action, bubble_ratio, build, check, forward_only, gpipe, in_flight_bound, interleaved, one_f_one_b,
    peak_in_flight, render, simulate, theory_bubble,
)


def _cases():
    for p in (1, 2, 4):
        for m in (p, 2 * p, 4 * p, 8 * p, p + 1):
            yield "gpipe", p, m, 1
            yield "1f1b", p, m, 1
            if p >= 2 and m % p == 0:
                yield "interleaved", p, m, 1
                yield "interleaved", p, m, 2
    yield "interleaved", 1, 3, 2  # both chunks on one rank: sends to itself
    yield "interleaved", 2, 4, 3


CASES = list(_cases())


def field_bounds(name, p, m, v):
    return [in_flight_bound(name, p, m, v, r) for r in range(p)]


def _assert_timeline_respects_dependencies(result, p, m, v):
    """Independent of the matching logic: data must flow F(s) -> F(s+1), B(s+1) -> B(s), F(s) -> B(s)."""
    t = {}
    for rank, spans in enumerate(result.intervals):
        for a, start, end in spans:
            t[(a.kind, a.micro, a.chunk * p + rank)] = (start, end)
    last = p * v - 1
    for micro in range(m):
        for s in range(last + 1):
            f, b = t[("forward", micro, s)], t[("backward", micro, s)]
            assert f[1] <= b[0]
            if s < last:
                assert f[1] <= t[("forward", micro, s + 1)][0]
                assert t[("backward", micro, s + 1)][1] <= b[0]


@pytest.mark.parametrize("name,p,m,v", CASES)
def test_schedule_checks_and_simulates(name, p, m, v):
    schedule = build(name, p, m, v)
    check(schedule, p, m, v, max_in_flight=field_bounds(name, p, m, v))
    result = simulate(schedule, p, v)
    _assert_timeline_respects_dependencies(result, p, m, v)
    assert result.busy == [m * v * 3.0] * p  # every rank computes all its chunks once
    assert 0.0 <= result.bubble < 1.0


@pytest.mark.parametrize("name,p,m,v", [c for c in CASES if c[0] != "interleaved"])
def test_gpipe_and_1f1b_bubble_is_textbook(name, p, m, v):
    result = simulate(build(name, p, m), p)
    assert result.bubble == pytest.approx(theory_bubble(name, p, m), rel=1e-12, abs=1e-12)
    assert result.makespan == (m + p - 1) * 3.0


@pytest.mark.parametrize("p", (2, 4))
@pytest.mark.parametrize("k", (1, 2, 4, 8))
def test_interleaved_bubble_beats_1f1b_and_tracks_theory(p, k):
    m = k * p
    inter = simulate(build("interleaved", p, m, 2), p, 2).bubble
    # zero-latency sends make Megatron's schedule hit the formula exactly (even all-warm-up m == p)
    assert inter == pytest.approx(theory_bubble("interleaved", p, m, 2), rel=1e-12)
    if m >= 2 * p:
        assert inter < simulate(build("1f1b", p, m), p).bubble


@pytest.mark.parametrize("p,m", [(1, 1), (2, 2), (2, 3), (4, 4), (4, 5), (4, 16)])
def test_1f1b_peak_in_flight_is_exact(p, m):
    assert peak_in_flight(one_f_one_b(p, m)) == [min(p - r, m) for r in range(p)]


@pytest.mark.parametrize("p,m", [(2, 2), (2, 5), (4, 4), (4, 8), (4, 32)])
def test_interleaved_v1_is_1f1b(p, m):
    assert interleaved(p, m, 1) == one_f_one_b(p, m)


def test_interleaved_follows_megatron_order():
    # p=2, m=4, v=2: forwards F0.0 F1.0 F0.1 F1.1 F2.0 ...; backwards start from chunk 1;
    # warm-up 2*(p-r-1) + (v-1)*p = 4 on rank 0, 2 on rank 1.
    assert render(interleaved(2, 4, 2)) == (
        "rank 0: F0.0 F1.0 F0.1 F1.1 F2.0 B0.1 F3.0 B1.1 F2.1 B0.0 F3.1 B1.0 B2.1 B3.1 B2.0 B3.0\n"
        "rank 1: F0.0 F1.0 F0.1 B0.1 F1.1 B1.1 F2.0 B0.0 F3.0 B1.0 F2.1 B2.1 F3.1 B3.1 B2.0 B3.0")
    # m == p: Megatron runs every forward first
    assert render(interleaved(2, 2, 2)).splitlines()[1] == "rank 1: F0.0 F1.0 F0.1 F1.1 B0.1 B1.1 B0.0 B1.0"


def test_render_and_labels():
    assert render(one_f_one_b(2, 3)) == "rank 0: F0 F1 B0 F2 B1 B2\nrank 1: F0 B0 F1 B1 F2 B2"
    assert [str(Action(k, 3)) for k in ("recv_fwd", "forward", "send_fwd", "recv_bwd", "backward", "send_bwd")] \
        == ["rF3", "F3", "sF3", "rB3", "B3", "sB3"]
    assert str(Action("forward", 3, 1)) == "F3.1"


def test_communication_wraps_compute_at_stage_boundaries():
    F, B = (lambda i, c=0: Action("forward", i, c)), (lambda i, c=0: Action("backward", i, c))
    rF, sF = (lambda i, c=0: Action("recv_fwd", i, c)), (lambda i, c=0: Action("send_fwd", i, c))
    rB, sB = (lambda i, c=0: Action("recv_bwd", i, c)), (lambda i, c=0: Action("send_bwd", i, c))
    assert gpipe(2, 1) == [[F(0), sF(0), rB(0), B(0)], [rF(0), F(0), B(0), sB(0)]]
    # stage 2 = rank 0 chunk 1 sits mid-pipeline; stage 3 = rank 1 chunk 1 holds the loss
    rank0, rank1 = interleaved(2, 4, 2)
    i, j = rank0.index(F(0, 1)), rank1.index(F(0, 1))
    assert rank0[i - 1:i + 2] == [rF(0, 1), F(0, 1), sF(0, 1)]
    assert rank1[j - 1:j + 3] == [rF(0, 1), F(0, 1), B(0, 1), sB(0, 1)]  # loss: no send_fwd, no recv_bwd
    assert rank0[:2] == [F(0), sF(0)] and rank0[-2:] == [rB(3), B(3)]  # stage 0: no recv_fwd, no send_bwd


def test_theory_numbers():
    assert theory_bubble("1f1b", 4, 8) == pytest.approx(3 / 11)
    assert theory_bubble("interleaved", 4, 8, 2) == pytest.approx(1.5 / 9.5)
    assert theory_bubble("interleaved", 4, 8, 2) == pytest.approx(3 / 19)  # (p-1)/(v m + p-1)
    assert bubble_ratio("gpipe", 4, 8) == pytest.approx(3 / 8)
    assert bubble_ratio("interleaved", 4, 8, 2) == pytest.approx(3 / 16)


@pytest.mark.parametrize("args,message", [
    (("1f1b", 4, 3), r"gradient_accumulation_steps m=3 < stages p=4; raise gradient_accumulation_steps to 4"),
    (("gpipe", 2, 1), r"at least `stages` micro-batches"),
    (("interleaved", 4, 6, 2), r"m=6 .*multiple of stages p=4.*gradient_accumulation_steps to 4 or 8"),
    (("zigzag", 2, 2), r"unknown pipeline schedule 'zigzag'"),
    (("1f1b", 2, 4, 2), r"virtual_stages v=2 needs the interleaved schedule"),
    (("1f1b", 0, 4), r"pipeline stages p must be a positive integer, got 0"),
    (("interleaved", 2, 4, 0), r"virtual chunks v must be a positive integer"),
])
def test_build_errors(args, message):
    with pytest.raises(ValueError, match=message):
        build(*args)


def _without(acts, action):
    return [a for a in acts if a != action]


def test_check_catches_backward_before_forward():
    schedule = one_f_one_b(4, 8)
    block = [Action("recv_bwd", 0), Action("backward", 0), Action("send_bwd", 0)]
    schedule[1] = block + [a for a in schedule[1] if a not in block]
    with pytest.raises(ValueError, match=r"rank 1: backward B0.0 comes before its forward F0.0"):
        check(schedule, 4, 8)


def test_check_catches_removed_recv():
    schedule = one_f_one_b(4, 8)
    schedule[2] = _without(schedule[2], Action("recv_fwd", 3))
    with pytest.raises(ValueError, match=r"rank 2: forward F3.0 at stage 2 is not preceded by its recv_fwd"):
        check(schedule, 4, 8)


def test_check_catches_missing_and_duplicate_compute():
    schedule = gpipe(2, 2)
    schedule[1] = _without(schedule[1], Action("backward", 1))
    with pytest.raises(ValueError, match=r"backward of micro-batch 1 at stage 1 \(rank 1, chunk 0\) is missing"):
        check(schedule, 2, 2)
    schedule = gpipe(2, 2)
    schedule[0] = schedule[0] + [Action("forward", 0), Action("send_fwd", 0)]
    with pytest.raises(ValueError, match=r"forward of micro-batch 0 at stage 0 .* scheduled 2 times"):
        check(schedule, 2, 2)


def test_check_catches_misplaced_and_unmatched_communication():
    schedule = gpipe(2, 2)
    schedule[0].insert(0, Action("recv_fwd", 0))  # stage 0 has nobody to receive from
    with pytest.raises(ValueError, match=r"rank 0: recv_fwd rF0.0 \(stage -1 -> 0\) has no matching send_fwd"):
        check(schedule, 2, 2)
    schedule = gpipe(2, 2)
    schedule[1].append(Action("send_fwd", 1))  # not after its forward
    with pytest.raises(ValueError, match=r"rank 1: send_fwd sF1.0 is not after its forward"):
        check(schedule, 2, 2)


def test_check_enforces_in_flight_bound():
    check(gpipe(4, 8), 4, 8, max_in_flight=8)
    with pytest.raises(ValueError, match=r"rank 0 holds 8 micro-batch chunks in flight, more than 4"):
        check(gpipe(4, 8), 4, 8, max_in_flight=field_bounds("1f1b", 4, 8, 1))


def test_simulate_reports_deadlock():
    # both ranks receive first: rank 0 waits for a gradient rank 1 only sends after a forward it never gets
    schedule = [[Action("recv_bwd", 0), Action("backward", 0), Action("forward", 0), Action("send_fwd", 0)],
                [Action("recv_fwd", 0), Action("forward", 0), Action("backward", 0), Action("send_bwd", 0)]]
    with pytest.raises(RuntimeError, match=r"rank 0 waits at action 0 \(rB0.0\); rank 1 waits at action 0 \(rF0.0\)"):
        simulate(schedule, 2)


def test_simulate_finds_cross_rank_deadlock_that_check_allows():
    F, sF, rB, B = (lambda i: Action("forward", i)), (lambda i: Action("send_fwd", i)), \
        (lambda i: Action("recv_bwd", i)), (lambda i: Action("backward", i))
    rF, sB = (lambda i: Action("recv_fwd", i)), (lambda i: Action("send_bwd", i))
    schedule = [[F(0), sF(0), rB(0), B(0), F(1), sF(1), rB(1), B(1)],
                [rF(1), F(1), B(1), sB(1), rF(0), F(0), B(0), sB(0)]]
    # locally consistent, but the two ranks order the forwards between them differently (NCCL would fill F1's
    # buffer with F0)...
    with pytest.raises(ValueError, match=r"rank 0 sends sF0.0 \(stage 0 -> 1\) as its message #0 to rank 1, which "
                                         r"receives rF1.0 .* in order, not by tag"):
        check(schedule, 2, 2)
    with pytest.raises(RuntimeError, match=r"deadlocks: rank 0 waits at action 2 \(rB0.0\); rank 1 waits"):
        simulate(schedule, 2)  # ...and rank 0 waits for B0 while rank 1 waits for F1


def test_simulate_costs_are_per_compute():
    result = simulate(gpipe(1, 3), 1, t_fwd=1.5, t_bwd=0.5)
    assert result.makespan == 6.0 and result.bubble == 0.0
    assert [(str(a), s, e) for a, s, e in result.intervals[0][:2]] == [("F0", 0.0, 1.5), ("F1", 1.5, 3.0)]


def test_simulate_with_unequal_stages_costs_the_imbalance():
    """Per-stage times: a last stage twice as slow stalls the first (its idle time is the imbalance)."""
    from bunsan.pipeline.schedules import build, simulate
    even = simulate(build("1f1b", 2, 8), 2, 1, [1.0, 1.0], [2.0, 2.0])
    assert even.bubble == pytest.approx(theory_bubble("1f1b", 2, 8))
    slow = simulate(build("1f1b", 2, 8), 2, 1, [1.0, 2.0], [2.0, 4.0])
    assert slow.busy == [24.0, 48.0] and slow.bubble > even.bubble
    assert slow.makespan == pytest.approx(3.0 + 8 * 6.0)   # stage 1 never waits after the first forward


# -- NCCL's rules (p2p_rules.py): in-order matching, sends that wait for their receives, one batch per slot --

NCCL_CASES = [c for c in CASES if c[1] > 1]


@pytest.mark.parametrize("name,p,m,v", NCCL_CASES)
def test_every_schedule_completes_under_nccl_rules_with_the_buffered_timeline(name, p, m, v):
    schedule = build(name, p, m, v)
    buffered, nccl = simulate(schedule, p, v), simulate(schedule, p, v, rules="nccl")
    assert nccl.makespan == pytest.approx(buffered.makespan) and nccl.bubble == pytest.approx(buffered.bubble)


@pytest.mark.parametrize("p,m,v", [(2, 1, 1), (2, 3, 2), (4, 4, 1), (4, 2, 3), (3, 5, 2)])
def test_evaluation_lists_check_under_nccl_rules(p, m, v):
    check(forward_only(p, m, v), p, m, v, forward_only=True)


def test_sends_that_only_gloo_buffers_deadlock_under_nccl():
    """Rank 0 runs GPipe (all forwards, then the backwards), rank 1 runs 1F1B. gloo buffers rank 0's sends, so
    the lists complete; under NCCL rank 0's send of F2 waits for a receive rank 1 posts only after a gradient
    rank 0 receives after that send."""
    schedule = [gpipe(2, 4)[0], one_f_one_b(2, 4)[1]]
    simulate(schedule, 2)                                  # buffered: completes
    with pytest.raises(RuntimeError, match=r"deadlocks under NCCL's rules .*: rank 0 waits at batch \[sF2.0\]; "
                                           r"rank 1 waits at batch \[sB0.0 rF1.0\]"):
        simulate(schedule, 2, rules="nccl")
    with pytest.raises(ValueError, match=r"deadlocks under NCCL's rules"):
        check(schedule, 2, 4)


@pytest.mark.parametrize("p,m,v", [(2, 4, 2), (4, 8, 2), (3, 6, 3)])
def test_interleaving_needs_megatrons_pairs_under_nccl(p, m, v):
    """The interleaved order with one batch between each two computes deadlocks on NCCL; grouped as Megatron
    does (a forward and a backward back to back, their four transfers one batch) it completes."""
    from bunsan.pipeline.schedules import interleaved_warmup, megatron_slot, pipedream_order, wrap_with_p2p
    fwd, bwd = megatron_slot("forward", p, v), megatron_slot("backward", p, v)
    per_compute = [wrap_with_p2p(pipedream_order(m * v, interleaved_warmup(p, m, v, r), fwd, bwd), r, p, v)
                   for r in range(p)]
    simulate(per_compute, p, v)                            # buffered: completes
    with pytest.raises(ValueError, match=rf"deadlocks under NCCL's rules .*: rank 0 waits at batch \[sB0.{v - 1}\]"):
        check(per_compute, p, m, v)
    check(build("interleaved", p, m, v), p, m, v)


def test_the_first_forward_message_of_a_stage_carries_a_header_read_before_its_receive():
    from bunsan.pipeline import p2p_rules
    schedule = build("1f1b", 2, 3)
    headed = p2p_rules.header_links(schedule[1], 1, 2)
    assert headed == {("fwd", 0, 0, 1)}                     # once per stage and step, the first micro-batch
    plan = p2p_rules.plan(schedule[1], 1, 2, headed)
    assert plan[0].headers and plan[0].ops == (("recv", ("hdr", "fwd", 0, 0, 1)),)
    assert plan[1].ops == (("recv", ("fwd", 0, 0, 1)),)
