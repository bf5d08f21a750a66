"""Checkpoints: exact resume on the same layout, any layout from any other, and damaged checkpoints refused."""

import json
import os
from pathlib import Path

import pytest
import torch

from parity import assert_parity, batches, optimizer_config, rank_slice, reference_train, tiny_model

STEPS, SPLIT, ROWS = 6, 3, 8


def _cfg(zero=0, tp=1, pp=1, accum=2, opt="adamw", bf16=False, **extra):
    cfg = {"train_batch_size": ROWS, "gradient_accumulation_steps": accum, "optimizer": optimizer_config(opt),
           "zero_optimization": {"stage": zero}, "tensor_parallel": {"size": tp}, "pipeline": {"stages": pp},
           "bf16": {"enabled": bf16}, "train": {"timeout_s": 60}}
    cfg.update(extra)
    return cfg


def _run(rank, world, cfg, ckpt, mode, tied=False):
    """mode: 'all' trains STEPS; 'save' trains SPLIT and saves; 'load' starts from other weights, loads, trains
    the rest. Returns (losses, full fp32 weights)."""
    import bunsan
    model = tiny_model(seed=7 if mode == "load" else 0, tie_word_embeddings=tied)
    engine = bunsan.initialize(model, cfg)
    data = batches(STEPS, ROWS)
    start = 0
    if mode == "load":
        path, client = engine.load_checkpoint(ckpt)
        start = client["next_step"]
        assert engine.global_step == start == SPLIT, (engine.global_step, client)
    stop = SPLIT if mode == "save" else STEPS
    losses = [engine.train_batch(rank_slice(data[s], engine.dp_rank, engine.dp_size)) for s in range(start, stop)]
    if mode == "save":
        engine.save_checkpoint(ckpt, client_state={"next_step": stop})
    state = {k: v.float() for k, v in engine.consolidated_state_dict().items()}
    return losses, state


@pytest.mark.parametrize("layout", [
    dict(world=2, zero=0), dict(world=2, zero=1), dict(world=2, zero=2), dict(world=2, zero=3),
    dict(world=2, tp=2), dict(world=2, pp=2), dict(world=2, zero=1, bf16=True),
    dict(world=2, zero=0, fp16={"enabled": True, "initial_scale_power": 8}),
    dict(world=2, zero=2, offload="nvme"), dict(world=2, zero=3, offload="cpu"), dict(world=4, pp=2, zero=3),
])
def test_resume_is_bit_exact_on_the_same_layout(pools, tmp_path, layout):
    layout = dict(layout)
    world = layout.pop("world")
    offload = layout.pop("offload", None)
    cfg = _cfg(**layout)
    if offload:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": offload, "nvme_path": str(tmp_path / "swap")}
        if offload == "cpu":
            cfg["zero_optimization"]["offload_param"] = {"device": "cpu"}
    tmp_path = tmp_path / "ckpt"
    whole = pools.run(world, _run, world, cfg, None, "all")
    pools.run(world, _run, world, cfg, str(tmp_path), "save")
    resumed = pools.run(world, _run, world, cfg, str(tmp_path), "load")
    for (all_losses, all_state), (tail, state) in zip(whole, resumed):
        assert tail == all_losses[SPLIT:]                   # bit for bit
        for k in all_state:
            assert torch.equal(state[k], all_state[k]), k


# (saving layout, loading layout): world sizes 1, 2, 4 across DP, ZeRO 0-3, TP and PP. AdamW's states where
# only ZeRO changes; SGD's momentum where TP is involved (TP sums in another order, and Adam turns that
# 1e-9 noise on near-zero gradients into 1e-6 weight differences whatever the checkpoint does).
RESHARD = [
    (dict(world=2, zero=3), dict(world=1, zero=0)),
    (dict(world=1, zero=0), dict(world=4, zero=2)),
    (dict(world=4, zero=1), dict(world=2, zero=3)),
    (dict(world=2, tp=2, opt="sgd"), dict(world=2, zero=1, opt="sgd")),
    (dict(world=4, tp=2, zero=1, opt="sgd"), dict(world=2, pp=2, opt="sgd")),
    (dict(world=2, pp=2, tied=True, opt="sgd"), dict(world=4, tp=2, zero=3, tied=True, opt="sgd")),
    (dict(world=1, opt="sgd"), dict(world=2, tp=2, opt="sgd")),
    # pipeline stages with ZeRO-2/3 (AdamW: only the sharding changes within a stage)
    (dict(world=4, pp=2, zero=3, tied=True), dict(world=1, zero=0, tied=True)),
    (dict(world=2, zero=1), dict(world=4, pp=2, zero=2)),
    (dict(world=4, pp=2, zero=2), dict(world=2, pp=2, zero=3)),
]


@pytest.mark.parametrize("save,load", RESHARD, ids=lambda d: "-".join(f"{k}{v}" for k, v in d.items()))
def test_any_layout_loads_any_other(pools, tmp_path, save, load):
    save, load = dict(save), dict(load)
    tied = save.pop("tied", False)
    load.pop("tied", None)
    ws, wl = save.pop("world"), load.pop("world")
    first = pools.run(ws, _run, ws, _cfg(**save), str(tmp_path), "save", tied)
    second = pools.run(wl, _run, wl, _cfg(**load), str(tmp_path), "load", tied)
    opt = load.get("opt", "adamw")
    ref = reference_train(tiny_model(0, tie_word_embeddings=tied), batches(STEPS, ROWS), opt)
    assert_parity([(first[0][0] + second[0][0], second[0][1])], ref)    # the saving run's steps, then the loading run's


def _save_twice(rank, world, root, n=2, keep=None):
    import bunsan
    engine = bunsan.initialize(tiny_model(0), _cfg(zero=1 if world > 1 else 0))
    data = batches(n, ROWS)
    for s in range(n):
        engine.train_batch(rank_slice(data[s], engine.dp_rank, engine.dp_size))
        engine.save_checkpoint(root, client_state={"step": s + 1}, keep_last=keep)
    return engine.consolidated_state_dict()["norm.weight"].tolist()


def _load(rank, world, root, tag=None):
    import bunsan
    engine = bunsan.initialize(tiny_model(5), _cfg(zero=1 if world > 1 else 0))
    path, client = engine.load_checkpoint(root, tag)
    return Path(path).name, client, engine.global_step


def test_layout_of_a_checkpoint_directory(pools, tmp_path):
    pools.run(2, _save_twice, 2, str(tmp_path))
    assert (tmp_path / "latest").read_text() == "global_step2"
    d = tmp_path / "global_step2"
    assert sorted(p.name for p in d.iterdir()) == ["meta.json", "meta.sha256", "rank00000.safetensors",
                                                   "rank00001.safetensors"]
    meta = json.loads((d / "meta.json").read_text())
    assert meta["step"] == 2 and meta["layout"]["dp"] == 2 and meta["client_state"] == {"step": 2}
    assert all(len(f["sha256"]) == 64 for f in meta["files"].values())
    assert not list(tmp_path.glob(".tmp-*"))


def test_damaged_checkpoint_falls_back_to_the_previous(pools, tmp_path, capfd):
    pools.run(2, _save_twice, 2, str(tmp_path))
    victim = tmp_path / "global_step2" / "rank00001.safetensors"
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) // 2])                      # truncated
    name, client, step = pools.run(2, _load, 2, str(tmp_path))[0]
    assert (name, client, step) == ("global_step1", {"step": 1}, 1)
    mid = len(data) // 2
    victim.write_bytes(data[:mid] + bytes([data[mid] ^ 0xFF]) + data[mid + 1:])   # same size, one byte altered
    assert pools.run(2, _load, 2, str(tmp_path))[0][0] == "global_step1"
    for f in (tmp_path / "global_step1").glob("*.safetensors"):
        f.write_bytes(f.read_bytes()[:100])
    with pytest.raises(AssertionError, match="no loadable checkpoint.*rank0000[01].safetensors has 100 bytes"):
        pools.run(2, _load, 2, str(tmp_path))


def _crash_during_save(rank, world, root):
    import bunsan
    from bunsan.checkpoint import store
    engine = bunsan.initialize(tiny_model(0), _cfg(zero=1))
    engine.train_batch(rank_slice(batches(1, ROWS)[0], engine.dp_rank, engine.dp_size))
    if rank == 1:
        store.write_rank = lambda *a, **k: os._exit(3)   # dies mid-save, as a SIGKILL would
    engine.save_checkpoint(root)


@pytest.mark.e2e
def test_a_crash_during_a_save_leaves_the_previous_checkpoint(pools, tmp_path):
    pools.run(2, _save_twice, 2, str(tmp_path))
    with pytest.raises((AssertionError, TimeoutError)):
        pools.run(2, _crash_during_save, 2, str(tmp_path), timeout=90)
    assert (tmp_path / "latest").read_text() == "global_step2"
    assert pools.run(2, _load, 2, str(tmp_path))[0][:2] == ("global_step2", {"step": 2})


def test_keep_last(pools, tmp_path):
    pools.run(1, _save_twice, 1, str(tmp_path), 4, 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step3", "global_step4", "latest"]
    assert pools.run(1, _load, 1, str(tmp_path), "global_step3")[0][:2] == ("global_step3", {"step": 3})


def _no_pickle(rank, world, root):
    import pickle
    import bunsan
    engine = bunsan.initialize(tiny_model(5), _cfg())

    def refuse(*a, **k):
        raise AssertionError("a checkpoint must be read without pickle")
    pickle.loads = pickle.load = torch.load = refuse
    engine.load_checkpoint(root)
    return True


def test_checkpoints_are_read_without_pickle(pools, tmp_path):
    pools.run(1, _save_twice, 1, str(tmp_path))
    assert pools.run(1, _no_pickle, 1, str(tmp_path)) == [True]
    pools.discard(1)   # its pickle is broken now


def test_missing_checkpoint_is_a_clear_error(pools, tmp_path):
    with pytest.raises(AssertionError, match="no checkpoint in .*no `latest`"):
        pools.run(1, _load, 1, str(tmp_path))


def _tags(rank, world, root):
    import warnings

    import bunsan
    engine = bunsan.initialize(tiny_model(), {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1}})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        path = engine.save_checkpoint(root, tag=0.25 if rank == 0 else 0.5)   # a loss as the tag, as DeepSpeed's docs
    loaded, _ = engine.load_checkpoint(root, tag="0.25")
    return str(path), str(loaded), [str(w.message) for w in caught]


def test_checkpoint_tags_are_any_scalar_and_rank_0s_wins(pools, tmp_path):
    """DeepSpeed's docs save with tag=loss.item(); ranks that disagree save under rank 0's tag, warned."""
    (p0, l0, w0), (p1, l1, w1) = pools.run(2, _tags, 2, str(tmp_path))
    assert p0 == p1 == l0 == l1 == str(tmp_path / "0.25")
    assert not w0 and any("differs from rank 0's '0.25'" in w for w in w1)


# -- learning rates the script owns (no configured scheduler): it halves them after every step, writing
# engine.optimizer's groups as transformers' Trainer's LambdaLR does; nothing of that is in its own state ---
def _two_groups(model, lr):
    *rest, (_, last) = model.named_parameters()   # at ZeRO 1-3 only the last rank's shard holds it
    return torch.optim.SGD([{"params": [p for _, p in rest]}, {"params": [last], "lr": 2 * lr}],
                           lr=lr, momentum=0.9)


def _script_schedule(rank, world, zero, root, mode):
    import bunsan
    model = tiny_model(seed=7 if mode == "load" else 0)
    engine = bunsan.initialize(model, _cfg(zero=zero, accum=1, opt="sgd"), optimizer=_two_groups(model, 0.1))
    data, start = batches(STEPS, ROWS), 0
    if mode == "load":
        engine.load_checkpoint(root)
        start = engine.global_step
    losses = []
    for s in range(start, SPLIT if mode == "save" else STEPS):
        losses.append(engine.train_batch(rank_slice(data[s], engine.dp_rank, engine.dp_size)))
        for g in engine.optimizer.param_groups:
            g["lr"] *= 0.5
    if mode == "save":
        engine.save_checkpoint(root)
    return losses, [g["lr"] for g in engine.optimizer.param_groups]


@pytest.mark.parametrize("zero", [0, 2])
def test_rates_a_script_scheduler_set_come_back_with_the_checkpoint(pools, tmp_path, zero):
    """Resumed, step 4 runs at the rates step 3 left (not the rates the optimizer was built with): SGD with
    momentum, whose step-4 update shows a wrong lr in every later loss."""
    whole = pools.run(2, _script_schedule, 2, zero, str(tmp_path), "all")
    pools.run(2, _script_schedule, 2, zero, str(tmp_path), "save")
    resumed = pools.run(2, _script_schedule, 2, zero, str(tmp_path), "load")
    for (all_losses, all_lrs), (rest, lrs) in zip(whole, resumed):
        assert rest == pytest.approx(all_losses[SPLIT:], rel=1e-6) and lrs == pytest.approx(all_lrs, rel=1e-12)


def _built_with(rank, world, root, lr):
    import logging

    import bunsan
    model = tiny_model(0)
    engine = bunsan.initialize(model, _cfg(zero=2, accum=1, opt="sgd"), optimizer=_two_groups(model, lr))
    if lr == 0.1:                   # the run that saves: the script halves its rates after one step
        engine.train_batch(rank_slice(batches(1, ROWS)[0], engine.dp_rank, engine.dp_size))
        for g in engine.optimizer.param_groups:
            g["lr"] /= 2
        engine.save_checkpoint(root)
    caught = []
    handler = logging.Handler()
    handler.emit = lambda record: caught.append(record.getMessage())
    logging.getLogger("bunsan.optim").addHandler(handler)
    try:
        engine.load_checkpoint(root)
    finally:
        logging.getLogger("bunsan.optim").removeHandler(handler)   # (the worker process runs later tests)
    return sorted({g["lr"] for g in engine.optimizer.param_groups}), caught


def test_rates_built_other_than_the_checkpoints_stand_warned(pools, tmp_path):
    """Same build: the saved (halved) rates come back. Built with another lr: the script changed it for the
    resumed run, so it stands, and the warning names both."""
    (same, quiet), _ = pools.run(2, _built_with, 2, str(tmp_path), 0.1)
    assert same == [0.05, 0.1] and not quiet
    (other, warned), _ = pools.run(2, _built_with, 2, str(tmp_path), 0.3)
    assert other == [0.3, 0.6] and any("built with lr 0.1 and is now built with lr 0.3" in w for w in warned)
