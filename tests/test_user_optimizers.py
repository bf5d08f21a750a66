"""The optimizer a user builds, the way users build it, kept on every layout: its class, its groups and their
hyperparameters, with the plain loop's numbers (fp32, rtol 1e-5) at 1 and 2 ranks.

`bunsan.initialize(model, config, optimizer=torch.optim.X(model.parameters(), ...))` for every elementwise
torch.optim class (and `foreach` / `fused` flags, two parameter groups), at ZeRO 0-3, with offload, under tensor,
pipeline and context parallelism; in bf16 against a replay of the casts; a class whose update would be cut
(LBFGS, Muon, an unknown one) is refused naming why, and runs where it can (Muon at stage 0).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import bunsan
from parity import Setup, assert_parity, batches, bf16_replay, build_model, rank_slice, reference_train, to_numpy, \
    tiny_model
from test_parity_sgd import layout

SETUP = Setup(steps=3, rows=8, seq=16)


def _two_groups(cls, **kw):
    """Norm weights without weight decay and at half the learning rate: the common recipe."""
    def make(model):
        norms = [p for n, p in model.named_parameters() if "norm" in n]
        rest = [p for n, p in model.named_parameters() if "norm" not in n]
        return cls([{"params": rest}, {"params": norms, "weight_decay": 0.0, "lr": kw["lr"] / 2}], **kw)
    return make


def _ds_adam():
    from bunsan.deepspeed.ops import adam
    return adam


def _plain(cls, **kw):
    return lambda model: cls(model.parameters(), **kw)


# name -> model -> optimizer, as a user writes it. Adaptive optimizers with eps 1e-4 (see parity.make_optimizer: an
# element whose gradient sits at the fp32 noise floor turns reduction-order noise into lr-sized moves at 1e-8).
EPS = 1e-4
USER_OPTIMIZERS = {
    "SGD": _plain(torch.optim.SGD, lr=0.05),      # linear in the gradient, no clipping: a scale error shows
    "SGD-nesterov": _plain(torch.optim.SGD, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01),
    "Adam": _plain(torch.optim.Adam, lr=1e-3, eps=EPS),
    "AdamW": _plain(torch.optim.AdamW, lr=1e-3, eps=EPS),
    "AdamW-two-groups": _two_groups(torch.optim.AdamW, lr=1e-3, eps=EPS, weight_decay=0.1),
    "AdamW-amsgrad-foreach": _plain(torch.optim.AdamW, lr=1e-3, eps=EPS, amsgrad=True, foreach=True),
    "Adam-fused": _plain(torch.optim.Adam, lr=1e-3, eps=EPS, fused=True),
    "RMSprop": _plain(torch.optim.RMSprop, lr=1e-3, eps=EPS, alpha=0.9, momentum=0.9),
    "Adagrad": _plain(torch.optim.Adagrad, lr=1e-2, eps=EPS, initial_accumulator_value=0.1, lr_decay=0.01),
    "Adamax": _plain(torch.optim.Adamax, lr=2e-3, eps=EPS),
    "NAdam": _plain(torch.optim.NAdam, lr=2e-3, eps=EPS),
    "RAdam": _plain(torch.optim.RAdam, lr=1e-3, eps=EPS, decoupled_weight_decay=True, weight_decay=0.01),
    "Adadelta": _plain(torch.optim.Adadelta, lr=1.0, eps=EPS),
    "ASGD": _plain(torch.optim.ASGD, lr=0.05, t0=1.0),
    "Rprop": _plain(torch.optim.Rprop, lr=1e-3),
    # DeepSpeed's Adam classes, as DeepSpeed scripts build them (bunsan.deepspeed.ops.adam: torch's AdamW)
    "FusedAdam": lambda m: _ds_adam().FusedAdam(m.parameters(), lr=1e-3, eps=EPS, weight_decay=0.01),
    "DeepSpeedCPUAdam": lambda m: _ds_adam().DeepSpeedCPUAdam(m.parameters(), lr=1e-3, eps=EPS),
}
EVERY = list(USER_OPTIMIZERS)
USER_OPTIMIZERS["AdamW8bit"] = lambda m: __import__("bitsandbytes").optim.AdamW8bit(m.parameters(), lr=3e-3)
FEW = ["SGD", "AdamW-two-groups", "RMSprop", "Adagrad", "NAdam", "Rprop"]


def _runs(rank, world, cfg, names, setup, dtype=None):
    """Worker: for each optimizer name, build the model and the user's optimizer, initialize, train; what each
    name's engine stepped and learned."""
    out = {}
    for name in names:
        model = build_model(setup, cfg)
        optimizer = USER_OPTIMIZERS[name](model)
        engine = bunsan.initialize(model, cfg, optimizer=optimizer)
        losses = [engine.train_batch(rank_slice(b, engine.dp_rank, engine.dp_size)) for b in setup.data()]
        groups = [{k: v for k, v in g.items() if k in ("lr", "weight_decay", "eps", "momentum")}
                  for g in engine.optimizer.param_groups]
        kept = {type(o).__name__ for o in _torch_optimizers(engine)}
        out[name] = (losses, to_numpy(engine.consolidated_state_dict()), kept, groups)
    return out


def _torch_optimizers(engine):
    opt = engine.optimizer
    return [sg.optimizer for sg in opt.subgroups] if hasattr(opt, "subgroups") else [opt]


def _reference(name, setup=SETUP):
    model = tiny_model()
    return reference_train(model, setup.data(), lambda _: USER_OPTIMIZERS[name](model))


def _check(world, cfg, names, setup=SETUP, pools=None, what=""):
    runs = pools.run(world, _runs, world, cfg, names, setup)
    for name in names:
        ref = _reference(name, setup)
        assert_parity([r[name][:2] for r in runs], ref, what=f"{what} {name}")
        cls = type(USER_OPTIMIZERS[name](tiny_model())).__name__
        assert all(r[name][2] == {cls} for r in runs), f"{name}: bunsan stepped {runs[0][name][2]}, not {cls}"


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_every_elementwise_torch_optimizer_matches_the_plain_loop(pools, stage, world):
    _, cfg, setup = layout(dp=world, stage=stage)
    _check(world, cfg, EVERY, setup, pools, f"zero{stage} x{world}")


LAYOUTS = {
    "zero2-offload-cpu": layout(dp=2, stage=2, offload_optimizer="cpu"),
    "zero3-offload-nvme": layout(dp=2, stage=3, offload_optimizer="nvme", offload_param="cpu"),
    "tp2": layout(tp=2),
    "tp2-sp-zero1": layout(tp=2, sp=True, stage=1),
    "pp2-1f1b": layout(pp=2, m=2),
    "pp2-zero3": layout(pp=2, m=2, stage=3),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_user_optimizers_on_other_layouts(pools, tmp_path, name):
    world, cfg, setup = LAYOUTS[name]
    zero = cfg["zero_optimization"]
    if zero.get("offload_optimizer", {}).get("device") == "nvme":
        cfg = {**cfg, "zero_optimization": {**zero, "offload_optimizer": {"device": "nvme",
                                                                          "nvme_path": str(tmp_path)}}}
    _check(world, cfg, FEW, setup, pools, name)


# Not Rprop: it steps by the gradient's sign, and context parallelism sums each token's gradient from two ranks'
# attention chunks in another order; an embedding element whose step-3 gradient is -6.3e-6 in the plain loop (about
# 3x the ~2e-6 by which CP's SGD sums differ there) flips sign and moves 2 lr. Sign-based stepping of a gradient at
# the noise floor has no parity to hold; Rprop keeps its checks on the layouts above.
CP_FEW = [name for name in FEW if name != "Rprop"]


def test_user_optimizers_under_context_parallelism(pools):
    cfg = {"train_micro_batch_size_per_gpu": 8, "context_parallel": {"size": 2}, "train": {"timeout_s": 60}}
    _check(2, cfg, CP_FEW, SETUP, pools, "cp2")


# -- 16-bit: the user's class steps bunsan's fp32 masters; the same casts replayed by hand ----------------------
@pytest.mark.parametrize("world,stage", [(1, 0), (2, 0), (2, 1), (1, 2), (1, 3)])
def test_user_optimizers_in_bf16_match_the_replayed_casts(pools, world, stage):
    _, cfg, setup = layout(dp=world, stage=stage)
    cfg = {**cfg, "bf16": {"enabled": True}}
    names = ["SGD", "AdamW", "AdamW-two-groups", "RMSprop", "Adagrad"]
    runs = pools.run(world, _runs, world, cfg, names, setup)
    for name in names:
        assert_parity([r[name][:2] for r in runs], bf16_replay(USER_OPTIMIZERS[name], setup.data(), world), what=f"bf16 zero{stage} {name}")


def test_a_users_8bit_adamw_shards_under_zero(pools):
    """bitsandbytes' blocks are each shard's own: within 1% of the plain 8-bit loop (test_optim8bit.py)."""
    pytest.importorskip("bitsandbytes")
    _, cfg, setup = layout(dp=2, stage=2)
    ref = _reference("AdamW8bit", setup)
    for r in pools.run(2, _runs, 2, cfg, ["AdamW8bit"], setup):
        losses, _, kept, _ = r["AdamW8bit"]
        assert kept == {"AdamW8bit"}
        assert max(abs(a - b) / b for a, b in zip(losses, ref[0])) < 0.01, (losses, ref[0])


def test_user_optimizer_in_fp16_keeps_class_and_groups(pools):
    _, cfg, setup = layout(dp=2, stage=2)
    cfg = {**cfg, "fp16": {"enabled": True, "initial_scale_power": 8}}
    runs = pools.run(2, _runs, 2, cfg, ["AdamW-two-groups", "RMSprop"], setup)
    for r in runs:
        losses, _, kept, groups = r["AdamW-two-groups"]
        assert kept == {"AdamW"} and all(torch.isfinite(torch.tensor(losses)))
        assert {(g["lr"], g["weight_decay"]) for g in groups} == {(1e-3, 0.1), (5e-4, 0.0)}
        assert r["RMSprop"][2] == {"RMSprop"} and all(g["momentum"] == 0.9 for g in r["RMSprop"][3])


# -- what cannot step a fragment or a slice: refused naming why, or run on whole tensors ----------------------
def _build(cfg, make):
    model = tiny_model()
    return bunsan.initialize(model, {"train_micro_batch_size_per_gpu": 2, **cfg}, optimizer=make(model))


def _muon(model):
    return torch.optim.Muon([p for p in model.parameters() if p.dim() == 2], lr=0.02)


def _muon_model():
    model = tiny_model()
    for n, p in model.named_parameters():
        p.requires_grad_(p.dim() == 2)     # Muon takes matrices only
    return model


def test_muon_steps_whole_tensors_at_stage_0_and_is_refused_where_cut():
    """Muon orthogonalises in bf16, so reduction-order noise in the gradients moves its update by ~1%: the
    check is its step on the engine's own gradients, done by hand on a copy of the weights."""
    model = _muon_model()
    engine = bunsan.initialize(model, {"train_micro_batch_size_per_gpu": 8}, optimizer=_muon(model))
    ref = _muon_model()
    by_hand = _muon(ref)
    for b in batches(2, 8, 16):
        logits = engine(b["input_ids"])
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), b["labels"].reshape(-1))
        engine.backward(loss)
        with torch.no_grad():
            for (n, p), q in zip(engine.module.named_parameters(), ref.parameters()):
                q.copy_(p)
                q.grad = None if p.grad is None or not p.requires_grad else p.grad.clone()
        engine.step()
        by_hand.step()
        assert_parity([([], to_numpy(engine.module.state_dict()))], ([], ref.state_dict()), rtol=0, atol=0)
    for stage in (1, 2, 3):
        m = _muon_model()
        with pytest.raises(ValueError, match=r"Muon cannot step here: it orthogonalises each weight matrix as a "
                                             r"whole.*zero_optimization.stage 1-3"):
            bunsan.initialize(m, {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage}},
                              optimizer=_muon(m))


def test_lbfgs_and_sparse_adam_are_refused_with_why():
    with pytest.raises(ValueError, match=r"LBFGS cannot train under bunsan: it re-evaluates the loss"):
        _build({}, lambda m: torch.optim.LBFGS(m.parameters()))
    with pytest.raises(ValueError, match=r"SparseAdam cannot train under bunsan: it needs sparse gradients"):
        _build({"zero_optimization": {"stage": 1}}, lambda m: torch.optim.SparseAdam(m.parameters()))


class Lion(torch.optim.Optimizer):
    """A user's own elementwise optimizer (sign of an interpolated momentum)."""

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99)):
        super().__init__(params, dict(lr=lr, betas=betas))

    @torch.no_grad()
    def step(self, closure=None):
        for g in self.param_groups:
            b1, b2 = g["betas"]
            for p in g["params"]:
                if p.grad is None:
                    continue
                m = self.state[p].setdefault("exp_avg", torch.zeros_like(p))
                p.add_(torch.sign(m * b1 + p.grad * (1 - b1)), alpha=-g["lr"])
                m.mul_(b2).add_(p.grad, alpha=1 - b2)


class SubclassedSGD(torch.optim.SGD):
    """A subclass that changes only the constructor steps as SGD does."""

    def __init__(self, params, lr=0.05):
        super().__init__(params, lr=lr)


def test_an_unknown_class_is_refused_under_zero_until_declared():
    with pytest.raises(ValueError, match=r"Lion \(test_user_optimizers\) is not an optimizer bunsan knows: "
                                         r"zero_optimization.stage 1-3 .*bunsan.optim.declare\(Lion"):
        _build({"zero_optimization": {"stage": 2}}, lambda m: Lion(m.parameters()))
    engine = _build({}, lambda m: Lion(m.parameters()))          # stage 0: whole tensors, the class as is
    assert type(engine.optimizer) is Lion
    _build({"zero_optimization": {"stage": 2}}, lambda m: SubclassedSGD(m.parameters()))
    try:
        bunsan.optim.declare(Lion, "elementwise", state_bytes_per_element=4)
        engine = _build({"zero_optimization": {"stage": 2}}, lambda m: Lion(m.parameters(), lr=1e-3))
        engine.train_batch(batches(1, 2, 16)[0])
        assert {type(o) for o in _torch_optimizers(engine)} == {Lion}
        mem = engine.memory_report()
        assert mem["optimizer_states"] > 0 and mem["model_states"] == mem["theory_model_states"]
    finally:
        from bunsan.optim import stepping
        stepping._declared.pop(Lion, None)


def test_a_stepped_optimizer_is_refused_and_a_fresh_adagrad_is_not():
    model = tiny_model()
    opt = torch.optim.AdamW(model.parameters())
    model(batches(1, 2, 8)[0]["input_ids"]).sum().backward()
    opt.step()
    with pytest.raises(ValueError, match="AdamW passed to bunsan.initialize has already stepped"):
        bunsan.initialize(model, {"train_micro_batch_size_per_gpu": 2}, optimizer=opt)
    _build({"zero_optimization": {"stage": 1}}, lambda m: torch.optim.Adagrad(m.parameters()))


def _error_of(rank, world, cfg, name):
    model = tiny_model()
    try:
        bunsan.initialize(model, cfg, optimizer=USER_OPTIMIZERS[name](model) if name else None)
    except ValueError as e:
        return str(e)
    return None


def test_factored_and_whole_tensor_optimizers_are_refused_under_tensor_parallelism(pools):
    """A tensor-parallel slice has its own rows and columns: Adafactor's factored moments and Muon's
    orthogonalisation would be the slice's, not the weight's."""
    _, cfg, _ = layout(tp=2)
    adafactor = {**cfg, "optimizer": {"type": "Adafactor", "params": {"lr": 1e-2}}}
    for msg in pools.run(2, _error_of, 2, adafactor, None):
        assert msg and "Adafactor cannot step here: its row and column moments span whole rows and columns" in msg \
            and "tensor parallelism gives each rank a slice of each weight" in msg and "tensor_parallel.size 1" in msg


def test_bitsandbytes_settings_outside_defaults_follow_the_optimizer():
    """bitsandbytes keeps optim_bits, min_8bit_size, ... in `args` and paging in `is_paged`, not in `defaults`:
    they must reach the optimizers bunsan builds over shards; a bitsandbytes class that only shares a torch
    name is not torch's; per-parameter overrides cannot follow parameters and are refused."""
    bnb = pytest.importorskip("bitsandbytes")
    engine = _build({"zero_optimization": {"stage": 2}},
                    lambda m: bnb.optim.AdamW8bit(m.parameters(), lr=1e-3, min_8bit_size=16))
    assert {o.args.min_8bit_size for o in _torch_optimizers(engine)} == {16}
    engine.train_batch(batches(1, 2, 16)[0])
    with pytest.raises(ValueError, match=r"AdamW \(bitsandbytes.*\) is not an optimizer bunsan knows"):
        _build({"zero_optimization": {"stage": 1}}, lambda m: bnb.optim.AdamW(m.parameters(), optim_bits=8))
    model = tiny_model()
    manager = bnb.optim.GlobalOptimManager.get_instance()
    manager.register_parameters(model.parameters())
    manager.override_config(model.embed_tokens.weight, "optim_bits", 32)
    try:
        with pytest.raises(ValueError, match="per-parameter overrides"):
            bunsan.initialize(model, {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2}},
                              optimizer=bnb.optim.AdamW8bit(model.parameters()))
    finally:
        manager.pid2config.clear()
        manager.index2config.clear()


def _zero_init_runs(rank, world, cfg, setup):
    """bunsan.zero.Init (meta parameters, replaced by shards) with the user's two-group optimizer built on them."""
    model = build_model(setup, cfg)
    engine = bunsan.initialize(model, cfg, optimizer=USER_OPTIMIZERS["AdamW-two-groups"](model))
    losses = [engine.train_batch(rank_slice(b, engine.dp_rank, engine.dp_size)) for b in setup.data()]
    return losses, to_numpy(engine.consolidated_state_dict())


def test_a_users_groups_over_zero_init_meta_parameters(pools):
    from parity import reference_model
    _, cfg, setup = layout(dp=2, stage=3, build="zero_init")
    model = reference_model(setup)
    ref = reference_train(model, setup.data(), lambda _: USER_OPTIMIZERS["AdamW-two-groups"](model))
    assert_parity(pools.run(2, _zero_init_runs, 2, cfg, setup), ref, what="zero.Init + two groups")


def _partial_groups_runs(rank, world, cfg, setup):
    """The user's optimizer leaves lm_head out of every group and names a frozen norm: torch steps neither."""
    model = build_model(setup, cfg)
    model.norm.weight.requires_grad_(False)
    engine = bunsan.initialize(model, cfg, optimizer=_partial_sgd(model))
    losses = [engine.train_batch(rank_slice(b, engine.dp_rank, engine.dp_size)) for b in setup.data()]
    return losses, to_numpy(engine.consolidated_state_dict())


def _partial_sgd(model):
    return torch.optim.SGD([p for n, p in model.named_parameters() if n != "lm_head.weight"], lr=0.05,
                           momentum=0.9)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_parameters_a_users_optimizer_does_not_step_stay_put(pools, stage):
    _, cfg, setup = layout(dp=2, stage=stage)
    model = tiny_model()
    model.norm.weight.requires_grad_(False)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    ref = reference_train(model, setup.data(), lambda _: _partial_sgd(model))
    assert torch.equal(ref[1]["lm_head.weight"], init["lm_head.weight"])
    assert_parity(pools.run(2, _partial_groups_runs, 2, cfg, setup), ref, what=f"zero{stage}, partial groups")
