"""The estimate against real runs: 15 layouts of a 20M-parameter Llama on 2 gloo ranks (CPU).

Model-state bytes must agree within 5% and the peak resident set within 15% (issue #6). Each layout gets
fresh worker processes (forked: cheap), so one layout's heap cannot inflate the next one's peak; a forked
rank's baseline counts its parent's library pages as a started process would (estimate_runs.resident_as_started).
"""

import pytest

import estimate_runs as er

GiB = 1024 ** 3


@pytest.mark.parametrize("name,world,extra", er.LAYOUTS, ids=[n for n, _, _ in er.LAYOUTS])
def test_estimate_matches_a_real_run(pools, name, world, extra):
    try:
        results = pools.run(world, er.run_layout, extra)
    finally:
        pools.discard(world)
    for r in results:
        e = er.estimate_for(extra, world, r["baseline"])
        e_rank = e.stage_peaks[r["pp_rank"]]
        states = e.stage_states[r["pp_rank"]]["model_states"]
        assert states == pytest.approx(r["model_states"], rel=0.05), (name, states, r["model_states"])
        assert e_rank == pytest.approx(r["peak"], rel=0.15), \
            f"{name}: estimated peak {e_rank / GiB:.3f} GiB, measured {r['peak'] / GiB:.3f} GiB"
