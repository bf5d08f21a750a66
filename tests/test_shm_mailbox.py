"""Pipeline messages through shared memory (bunsan/comm/mailbox.py): any order, any dtype and shape, messages no
slot holds through gloo, everything released; a pipeline trains the same bits with it as over gloo."""

from __future__ import annotations

import pytest
import torch

import bunsan
from bunsan.comm import mailbox as shm_mailbox
from bunsan.comm.collectives import Comm
from bunsan.comm.mesh import Mesh
from parity import batches, optimizer_config, tiny_model

# (tag, tensor): the first two fit the test's 256-byte slots, the third does not (gloo), the fourth finds both
# slots taken (gloo), the last two are a bool matrix and a 0-dim scalar
MESSAGES = [(1, lambda: torch.arange(12, dtype=torch.float32).view(3, 4)),
            (3, lambda: torch.linspace(-1, 1, 10).to(torch.bfloat16)),
            (5, lambda: torch.arange(100, dtype=torch.int64)),
            (7, lambda: torch.full((2, 2, 2), 7.5, dtype=torch.float64)),
            (9, lambda: torch.eye(3, dtype=torch.bool)),
            (11, lambda: torch.tensor(2.5))]


def _exchange(rank, world):
    saved = shm_mailbox.SLOTS, shm_mailbox.SLOT_BYTES
    shm_mailbox.SLOTS, shm_mailbox.SLOT_BYTES = 2, 256
    try:
        group = Mesh.create().dp_group
        comm = Comm(timeout_s=30)
        box = comm.mailbox(group)
        assert box is not None
        got = {}
        if rank == 0:
            handles = [comm.post(box, make(), 1, group, tag) for tag, make in MESSAGES]
            got["back"] = comm.fetch(box, 1, group, 99)
            for h in handles:
                h.wait()
        else:
            for tag, _ in reversed(MESSAGES):          # received in the opposite order to their sending
                got[tag] = comm.fetch(box, 0, group, tag)
            comm.post(box, torch.ones(4, 4) * 3, 0, group, 99).wait()
        comm.barrier(group)
        released = all(not ch.descs[:, 0].any() and not ch.slots.any() for ch in box.channels.values())
        return got, released, comm.stats.summary()["total"]
    finally:
        shm_mailbox.SLOTS, shm_mailbox.SLOT_BYTES = saved


def test_messages_in_any_order_through_memory_or_gloo(pools):
    (got0, released0, stats0), (got1, released1, stats1) = pools.run(2, _exchange, 2)
    for tag, make in MESSAGES:
        want = make()
        assert got1[tag].dtype == want.dtype and torch.equal(got1[tag], want), tag
    assert torch.equal(got0["back"], torch.ones(4, 4) * 3)
    assert released0 and released1                   # every slot and descriptor free again
    sent = sum(make().numel() * make().element_size() for _, make in MESSAGES)
    assert stats0["send/dp"] == {"calls": len(MESSAGES), "bytes": sent}
    assert stats1["recv/dp"] == {"calls": len(MESSAGES), "bytes": sent}


def _pipeline(rank, world, mode):
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4,
           "optimizer": optimizer_config("sgd"), "pipeline": {"stages": 2, "schedule": "interleaved",
                                                               "virtual_stages": 2},
           "train": {"gloo_collectives": mode}}
    engine = bunsan.initialize(tiny_model(), cfg)
    losses = [engine.train_batch(b) for b in batches(2, 8, 16)]
    spans = len(engine.pipe.recorder.intervals)
    losses.append(engine.eval_batch(batches(1, 7, 16)[0]))     # forward only, micro-batches of 2, 2, 2, 1 rows
    assert len(engine.pipe.recorder.intervals) == spans        # evaluation is not in the last step's timeline
    return losses, engine.pipe.runner.p2p.box is not None


def test_a_pipeline_trains_the_same_through_memory_as_over_gloo(pools):
    shared = pools.run(2, _pipeline, 2, "shm")
    gloo = pools.run(2, _pipeline, 2, "exchange")
    assert all(used for _, used in shared) and not any(used for _, used in gloo)
    assert shared[1][0] == gloo[1][0]                # the last stage's losses, bit for bit


@pytest.mark.parametrize("p,pairs", [(1, []), (2, [(0, 1), (1, 0)]),
                                     (3, [(0, 1), (0, 2), (1, 0), (1, 2), (2, 0), (2, 1)]),
                                     (4, [(0, 1), (0, 3), (1, 0), (1, 2), (2, 1), (2, 3), (3, 0), (3, 2)])])
def test_channels_join_each_rank_to_its_next_and_previous(p, pairs):
    assert shm_mailbox.neighbour_pairs(p) == pairs


def test_a_stage_that_changes_its_message_shape_within_a_step_is_refused():
    """Headers go once per stage and step (the receiver allocates every later message from the first's)."""
    from bunsan.pipeline.runtime import P2P
    from bunsan.pipeline.schedules import Action
    p2p = object.__new__(P2P)
    p2p.shapes, p2p.device, p2p.every_header = {}, torch.device("cpu"), False
    head = p2p._header_for(0, torch.zeros(2, 16, 8), Action("send_fwd", 0))
    assert head.tolist()[:5] == [shm_mailbox.DTYPES.index(torch.float32), 3, 2, 16, 8]
    assert p2p._header_for(0, torch.zeros(2, 16, 8), Action("send_fwd", 1)) is None
    with pytest.raises(ValueError, match=r"stage 0 sends micro-batch 2 of shape \(1, 16, 8\).*first message of this "
                                         r"step had \(2, 16, 8\)"):
        p2p._header_for(0, torch.zeros(1, 16, 8), Action("send_fwd", 2))
    p2p.every_header = True                  # evaluation: a header per message, the last one shorter
    assert p2p._header_for(0, torch.zeros(1, 16, 8), Action("send_fwd", 2)).tolist()[2] == 1
