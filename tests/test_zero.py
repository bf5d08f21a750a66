"""ZeRO stages 1-3 (and offload) against the plain single-process loop; memory and traffic against the formulas."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import bunsan
from bunsan.zero.units import find_units
from parity import (ADAM_EPS, Setup, assert_parity, batches, optimizer_config, rank_slice, reference_train,
                    tiny_model, to_numpy, train)

STEPS, ROWS = 3, 12                      # 12 rows: divisible by 2 and 4 ranks x accumulation 1 and 3
SETUP = Setup(steps=STEPS, rows=ROWS)


def _cfg(world, stage, grad_accum, opt_name, clip, bf16=False, **zero):
    cfg = {"train_micro_batch_size_per_gpu": ROWS // world // grad_accum, "gradient_accumulation_steps": grad_accum,
           "optimizer": optimizer_config(opt_name), "gradient_clipping": clip,
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 50_000,
                                 "stage3_param_persistence_threshold": 0, **zero}}
    if bf16:
        cfg["bf16"] = {"enabled": True}
    return cfg


def _train(pools, world, cfg, build="plain"):
    return pools.run(world, train, world, cfg, SETUP.replace(build=build))


def _check(runs, opt_name, clip):
    assert_parity(runs, reference_train(tiny_model(), SETUP.data(), opt_name, clip))


# stage x world x accumulation x optimizer x clipping: every stage sees both world sizes, both
# accumulation settings and clipping on and off.
FP32_CASES = [(s, w, ga, opt, clip) for s in (1, 2, 3) for (w, ga, opt, clip) in
              ((2, 1, "adamw", 1.0), (2, 3, "sgd", 0.0), (4, 1, "sgd", 1.0), (4, 3, "adamw", 0.0))]


@pytest.mark.parametrize("stage,world,grad_accum,opt_name,clip", FP32_CASES)
def test_zero_fp32_matches_single_process(pools, stage, world, grad_accum, opt_name, clip):
    _check(_train(pools, world, _cfg(world, stage, grad_accum, opt_name, clip)), opt_name, clip)


# SGD without clipping (a uniform gradient-scale error) for these and the other offload layouts: test_parity_sgd.py
@pytest.mark.parametrize("stage,offload", [(1, "cpu"), (2, "nvme"), (3, "cpu"), (3, "nvme")])
def test_offloaded_optimizer_matches_single_process(pools, tmp_path, stage, offload):
    zero = {"offload_optimizer": {"device": offload, "nvme_path": str(tmp_path)}, "sub_group_size": 40_000}
    if stage == 3:   # parameter shards follow the optimizer: host memory, or the NVMe swap file
        zero["offload_param"] = {"device": offload, "nvme_path": str(tmp_path)}
    runs = _train(pools, 2, _cfg(2, stage, 1, "adamw", 1.0, **zero))
    _check(runs, "adamw", 1.0)
    psi = sum(p.numel() for p in tiny_model().parameters())
    for mem in (run.memory for run in runs):
        assert mem["host"] >= mem["optimizer_states"] + mem["master_weights"]
        if offload == "nvme":   # Adam's two fp32 states per element of the shard live on disk, not in memory
            assert mem["disk"] >= 8 * psi // 2 and mem["optimizer_states"] == 0
            if stage == 3:
                assert mem["disk"] >= 12 * psi // 2 and mem["params"] == 0


def test_zero_init_builds_the_same_model_as_a_normal_build(pools):
    a = _train(pools, 2, _cfg(2, 3, 1, "sgd", 0.0), "zero_init")
    b = _train(pools, 2, _cfg(2, 3, 1, "sgd", 0.0), "seeded")
    for ra, rb in zip(a, b):
        assert ra.losses == rb.losses
        assert_parity([ra], rb, rtol=0, atol=0)


@pytest.mark.parametrize("stage,grad_accum", [(1, 1), (2, 1), (3, 1), (1, 3)])
def test_bf16_zero_replays_stage_0_exactly(pools, stage, grad_accum):
    """Stage 0 in bf16 is checked against a hand replay of its casts (test_precision.py). ZeRO performs the
    same casts: bf16 gradients summed over 2 ranks, fp32 master step; so the results are identical. (With
    clipping the shard-wise norm rounds differently from the whole-vector norm; fp32 cases cover clipping.)"""
    ref = _train(pools, 2, _cfg(2, 0, grad_accum, "adamw", 0.0, bf16=True))
    got = _train(pools, 2, _cfg(2, stage, grad_accum, "adamw", 0.0, bf16=True))
    for r, g in zip(ref, got):
        assert_parity([g], r, rtol=0, atol=0, loss_rtol=1e-6)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("bf16", [False, True])
def test_model_state_bytes_follow_the_formula(pools, world, bf16):
    psi = sum(p.numel() for p in tiny_model().parameters())
    p_bytes = 2 if bf16 else 4
    master = 4 if bf16 else 0
    for stage in (0, 1, 2, 3):
        mem = _train(pools, world, _cfg(world, stage, 1, "adamw", 0.0, bf16=bf16))[0].memory
        # ZeRO paper, in the precision used (bunsan accumulates stage-2/3 gradient shards in fp32).
        formula = {0: psi * (2 * p_bytes + master + 8),
                   1: psi * 2 * p_bytes + psi * (master + 8) / world,
                   2: psi * p_bytes + psi * (4 + master + 8) / world,
                   3: psi * (p_bytes + 4 + master + 8) / world}[stage]
        padding = 16 * world * 10 * (p_bytes + 4 + master + 8)      # at most one aligned pad per bucket
        assert formula <= mem["model_states"] <= formula * 1.05 + padding, (stage, mem)
        assert mem["theory_model_states"] == pytest.approx(formula)


def test_communication_bytes_per_step(pools):
    psi = sum(p.numel() for p in tiny_model().parameters())
    root = sum(p.numel() for n, p in tiny_model().named_parameters() if not n.startswith("layers."))
    n = 2
    for stage in (1, 2, 3):
        stats = _train(pools, n, _cfg(n, stage, 1, "adamw", 0.0))[0].comm["step"]
        rs, ag = stats["reduce_scatter/dp"]["bytes"], stats["all_gather/dp"]["bytes"]
        ring = 4 * (n - 1) / n
        assert rs == pytest.approx(psi * ring, rel=0.01)            # gradients reduce-scattered once
        # stages 1-2: updated parameters all-gathered once; stage 3: gathered for forward and again for
        # backward, except the root unit (embedding, norm, head), which stays gathered for the step.
        expect = psi if stage < 3 else 2 * psi - root
        assert ag == pytest.approx(expect * ring, rel=0.01)
        assert rs + ag <= (3 if stage == 3 else 2) * psi * ring * 1.01


def _bf16_replay_fp32_accumulation(world: int, grad_accum: int):
    """Stages 2-3 in bf16 by hand: per micro-step, bf16 gradients of each rank summed in bf16 (what the
    reduce-scatter does), added to an fp32 gradient shard; then AdamW on fp32 masters, cast back to bf16."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # as the workers: bf16 kernels round differently when split differently
    try:
        model = tiny_model().to(torch.bfloat16)
        params = list(model.parameters())
        master = [p.detach().float().clone() for p in params]
        opt = torch.optim.AdamW(master, lr=1e-3, weight_decay=0.01, eps=ADAM_EPS)
        losses = []
        for b in batches(STEPS, ROWS):
            n = (b["labels"] != -100).sum().item()
            acc, total = [torch.zeros_like(m) for m in master], 0.0
            for m in range(grad_accum):
                summed = None
                for r in range(world):
                    mb = rank_slice(rank_slice(b, r, world), m, grad_accum)
                    logits = model(mb["input_ids"])
                    loss = F.cross_entropy(logits.float().reshape(-1, 256), mb["labels"].reshape(-1), reduction="sum")
                    g = torch.autograd.grad(loss / n, params)
                    summed = list(g) if summed is None else [x + y for x, y in zip(summed, g)]
                    total += loss.item()
                for a, g in zip(acc, summed):
                    a.add_(g.float())
            for m, a in zip(master, acc):
                m.grad = a
            opt.step()
            with torch.no_grad():
                for p, m in zip(params, master):
                    p.copy_(m)
            losses.append(total / n)
        return losses, to_numpy(model.state_dict())
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("stage", [2, 3])
def test_bf16_with_accumulation_replays_the_fp32_gradient_shard(pools, stage):
    assert_parity(_train(pools, 2, _cfg(2, stage, 3, "adamw", 0.0, bf16=True)), _bf16_replay_fp32_accumulation(2, 3),
                  rtol=0, atol=0, loss_rtol=1e-6)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_activation_checkpointing_at_every_stage(pools, stage):
    _check(_train(pools, 2, {**_cfg(2, stage, 1, "sgd", 1.0), "activation_checkpointing": {"enabled": True}}),
           "sgd", 1.0)


def _fp16(rank, world, stage):
    cfg = _cfg(world, stage, 2, "adamw", 1.0)
    cfg["fp16"] = {"enabled": True, "initial_scale_power": 24, "hysteresis": 1}
    engine = bunsan.initialize(tiny_model(), cfg)
    losses = [engine.train_batch(rank_slice(b, rank, world)) for b in batches(6, ROWS)]
    return losses, engine.skipped_steps, engine.loss_scale


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_fp16_loss_scaling_at_every_stage(pools, stage):
    """2**24 overflows fp16 gradients: steps are skipped on every rank alike, the scale halves, training goes on."""
    results = pools.run(2, _fp16, 2, stage)
    assert results[0] == results[1]
    losses, skipped, scale = results[0]
    assert skipped >= 1 and scale < 2**24 and all(np.isfinite(losses))


def _gathered(rank, world):
    engine = bunsan.initialize(tiny_model(), _cfg(world, 3, 1, "sgd", 0.0))
    w = engine.module.layers[0].mlp.up_proj.weight
    outside = engine.strategy.resident_bytes(w)           # released: the unit's buffer holds no memory
    with engine.gathered_parameters():
        inside = tuple(w.shape), float(w.detach().sum()), engine.strategy.resident_bytes(w)
    return outside, inside, engine.strategy.resident_bytes(w)


def test_stage3_parameters_are_reachable_through_the_gather_context(pools):
    full = tiny_model().layers[0].mlp.up_proj.weight
    for outside, (shape, total, held), after in pools.run(2, _gathered, 2):
        assert outside == 0 and after == 0 and held >= full.numel() * 4
        assert shape == tuple(full.shape) and total == pytest.approx(float(full.detach().sum()), rel=1e-6)


def _step_events(rank, world, stage):
    engine = bunsan.initialize(tiny_model(), _cfg(world, stage, 1, "adamw", 0.0))
    dp, events = engine.strategy, []
    for k, sg in enumerate(dp.opt.subgroups):
        def step(closure=None, k=k, inner=sg.optimizer.step):
            events.append(("step", k))
            return inner(closure)
        sg.optimizer.step = step
    gather, zeros = dp.comm.all_gather, dp.reducer._zeros

    def all_gather(*a, **kw):
        events.append(("gather", None))
        return gather(*a, **kw)

    def counted_zeros(*a, **kw):
        events.append(("buffer", None))
        return zeros(*a, **kw)
    dp.comm.all_gather, dp.reducer._zeros = all_gather, counted_zeros
    engine.train_batch(rank_slice(batches(1, ROWS)[0], rank, world))
    return events, len(dp.layout.buckets)


@pytest.mark.parametrize("stage", [1, 2])
def test_all_gathers_start_while_later_slices_step(pools, stage):
    """Stages 1-2: one sub-group per bucket slice, each bucket's all-gather launched right after its slice
    steps; at stage 1 the reduce-scatter lands in the fp32 gradient shard without an output buffer."""
    for events, n_buckets in pools.run(2, _step_events, 2, stage):
        kinds = [e[0] for e in events if e[0] != "buffer"]
        assert n_buckets > 2 and kinds.count("step") == n_buckets and kinds.count("gather") == n_buckets
        assert kinds == ["step", "gather"] * n_buckets, kinds
        if stage == 1:
            assert ("buffer", None) not in events


class _Block(torch.nn.Module):
    def __init__(self, width, use_extra):
        super().__init__()
        self.used, self.extra, self.use_extra = torch.nn.Linear(width, width), torch.nn.Linear(width, width), use_extra

    def forward(self, x):
        x = torch.tanh(self.used(x))
        return x + torch.tanh(self.extra(x)) if self.use_extra else x


class _HalfUsed(torch.nn.Module):
    """Blocks of equal size (so their gradient buckets share buffers); the first half skip `extra`, whose slot
    in their bucket then holds no gradient and must read as zero, whatever a later block's bucket (reduced
    earlier in backward) left there. Width 12: each bucket ends in padding."""

    def __init__(self, blocks=6, width=12):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(_Block(width, i >= blocks // 2) for i in range(blocks))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def _half_used_data():
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(8, 12, generator=g), torch.randn(8, 12, generator=g)) for _ in range(STEPS)]


def _train_half_used(rank, world, stage):
    block = 2 * (12 * 12 + 12)
    engine = bunsan.initialize(_HalfUsed(), {
        "train_micro_batch_size_per_gpu": 8 // world, "optimizer": optimizer_config("sgd"),
        "zero_optimization": {"stage": stage, "reduce_bucket_size": block, "stage3_param_persistence_threshold": 0,
                              "stage3_unit_modules": ["_Block"]}}, loss_fn=F.mse_loss)
    reuse, reused = engine.strategy.reducer._reuse, []

    def counted(*a):
        buf = reuse(*a)
        reused.append(buf is not None)
        return buf
    engine.strategy.reducer._reuse = counted
    losses = [engine.train_batch(rank_slice(b, rank, world)) for b in _half_used_data()]
    return losses, to_numpy(engine.consolidated_state_dict()), sum(reused)


@pytest.mark.parametrize("stage", [2, 3])
def test_gradient_buckets_reused_within_a_backward_zero_what_got_no_gradient(pools, stage):
    ref = reference_train(_HalfUsed(), _half_used_data(), "sgd", loss_fn=F.mse_loss)
    runs = pools.run(2, _train_half_used, 2, stage)
    assert all(reused > 0 for _, _, reused in runs)    # some bucket really took a buffer an earlier one had filled
    assert_parity(runs, ref)


def test_a_container_as_stage3_unit_is_an_error():
    """A ModuleDict's forward never runs, so a unit hooked on it would never be gathered."""
    with pytest.raises(ValueError, match=r"\['ModuleDict'\].*forward is never called.*blocks inside it"):
        find_units(torch.nn.Sequential(torch.nn.ModuleDict({"a": torch.nn.Linear(2, 2)})),
                                      ["ModuleDict"])


def _prefetches(rank, bucket):
    cfg = _cfg(1, 3, 1, "sgd", 0.0, stage3_prefetch_bucket_size=bucket)
    engine = bunsan.initialize(tiny_model(), cfg)
    dp, seen = engine.strategy, []
    for k in dp.forward_order:        # when unit k's forward starts, is the next one already on its way?
        dp.units[k].module.register_forward_pre_hook(
            lambda m, a, k=k: seen.append([dp.units[j].pending is not None or dp.units[j].gathered
                                           for j in dp.forward_order]))
    engine.train_batch(batches(1, ROWS)[0])
    return seen, max(dp._size(k) for k in dp.forward_order)


@pytest.mark.parametrize("bucket", [1, 0])
def test_zero3_prefetches_the_next_unit_whatever_its_size(pools, bucket):
    """stage3_prefetch_bucket_size smaller than every block (a 1B model's blocks are all above DeepSpeed's 5e7)
    still prefetches the next block; 0 turns prefetch off."""
    (seen, largest), = pools.run(1, _prefetches, bucket)
    assert largest > 1
    ahead = [row[i + 1] for i, row in enumerate(seen[:-1])]     # forward of unit i: unit i+1 in flight
    assert ahead == [bucket > 0] * len(ahead) and len(ahead) >= 3
