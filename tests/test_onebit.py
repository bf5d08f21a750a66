"""1-bit Adam, 0/1 Adam and 1-bit LAMB (DeepSpeed's OneBitAdam, ZeroOneAdam, OneBitLamb) on 2 ranks:

- the compressed all-reduce (comm/onebit.py) is the two-phase error-feedback algorithm, step for step against a
  one-process simulation of both ranks, and moves a 1-bit tensor;
- in warm-up each optimizer trains as the same class in one process on the whole batch (fp32, rtol 1e-5);
- after it, the gradients are no longer all-reduced: the step's traffic falls below 1/8 of an fp32 all-reduce,
  the replicas stay equal (0/1 Adam: at every sync), and the loss converges as its full-precision counterpart's
  (the papers' claim, on a tiny regression).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from bunsan.comm.onebit import padded_size
from bunsan.config.root import Config

SEED, BATCH, STEPS = 0, 32, 240


def _sign(x):
    return (x >= 0).float() * 2 - 1


def _simulated(xs, worker_errors, server_errors):
    """Both ranks' compressed average, in one process: the algorithm of comm/onebit.py's docstring."""
    n, size = len(xs), worker_errors[0].numel()
    chunk = size // n
    sent = []
    for r, x in enumerate(xs):
        v = torch.zeros(size)
        v[:x.numel()] = x.reshape(-1)
        v += worker_errors[r]
        scale = v.norm() / size ** 0.5
        worker_errors[r].copy_(v - scale * _sign(v))
        sent.append(scale * _sign(v))
    out = []
    for r in range(n):
        y = sum(s[r * chunk:(r + 1) * chunk] for s in sent) / n + server_errors[r]
        scale = y.norm() / chunk ** 0.5
        server_errors[r].copy_(y - scale * _sign(y))
        out.append(scale * _sign(y))
    return torch.cat(out)[:xs[0].numel()].view_as(xs[0])


def _allreduce_rank(rank, world, steps):
    import bunsan
    from bunsan.comm.collectives import Comm
    from bunsan.comm.mesh import Mesh
    from bunsan.comm.onebit import OneBitAllReduce
    bunsan.init_distributed("gloo")
    comm, group = Comm(), Mesh.create().grad_group
    reduce = OneBitAllReduce(comm, group, 37, torch.device("cpu"))
    g = torch.Generator().manual_seed(rank)
    outs, sent = [], []
    for _ in range(steps):
        x = torch.randn(37, generator=g)
        sent.append(x.clone())
        comm.stats.new_step()
        outs.append(reduce(x).clone())
    return outs, sent, comm.stats.summary()["step_bytes"]


@pytest.mark.parametrize("world", [2, 4])
def test_compressed_allreduce_is_the_two_phase_error_feedback_algorithm(pools, world):
    results = pools.run(world, _allreduce_rank, world, 5)
    size = padded_size(37, world)
    worker, server = [torch.zeros(size) for _ in range(world)], [torch.zeros(size // world) for _ in range(world)]
    for k in range(5):
        want = _simulated([sent[k] for _, sent, _ in results], worker, server)
        for outs, _, _ in results:
            torch.testing.assert_close(outs[k], want)      # the same average on every rank
    # per rank, as DeepSpeed's compressed_allreduce: an all-to-all of the packed signs (each rank's own chunk
    # stays), an all-gather of the servers' signs, and two all-gathers of one fp32 scale per rank
    signs = size // 8 * (world - 1) // world
    assert results[0][2] == 2 * signs + 2 * 4 * (world - 1)


PARAMS = {
    "OneBitAdam": {"lr": 1e-2, "freeze_step": 80, "weight_decay": 0.01, "bias_correction": False,
                   "cuda_aware": False, "comm_backend_name": "nccl"},
    "ZeroOneAdam": {"lr": 1e-2, "var_freeze_step": 80, "var_update_scaler": 16, "local_step_scaler": 40,
                    "local_step_clipper": 4, "bias_correction": False},
    "OneBitLamb": {"lr": 1e-2, "freeze_step": 120, "max_coeff": 0.3, "min_coeff": 0.01, "coeff_beta": 0.9,
                   "factor_max": 4.0, "factor_min": 0.5, "factor_threshold": 0.1},
    "UncorrectedAdam": {"lr": 1e-2, "weight_decay": 0.01},
    "Lamb": {"lr": 1e-2, "max_coeff": 0.3, "min_coeff": 0.01, "bias_correction": False},
}
FULL_PRECISION = {"OneBitAdam": "UncorrectedAdam", "ZeroOneAdam": "UncorrectedAdam", "OneBitLamb": "Lamb"}


def _net():
    torch.manual_seed(SEED)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))


def _batches():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(16, 1, generator=g)
    xs = [torch.randn(BATCH, 16, generator=g) for _ in range(STEPS)]
    return [(x, x @ w) for x in xs]


def _train_rank(rank, name, world):
    import bunsan
    bunsan.init_distributed("gloo")
    net = _net()
    engine = bunsan.initialize(net, {"train_batch_size": BATCH, "steps_per_print": 10 ** 6, "gradient_clipping": 1.0,
                                     "optimizer": {"type": name, "params": PARAMS[name]}})
    share = BATCH // world
    losses, traffic, agree = [], [], []
    for x, y in _batches():
        loss = F.mse_loss(engine(x[rank * share:(rank + 1) * share]), y[rank * share:(rank + 1) * share])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        traffic.append(engine.comm_stats()["step_bytes"])
        if world > 1:
            flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
            other = flat.clone()
            torch.distributed.broadcast(other, 0)       # (outside bunsan's Comm: not in the step's traffic)
            agree.append(torch.equal(flat, other))
    return losses, traffic, agree


@pytest.mark.parametrize("name", ["OneBitAdam", "ZeroOneAdam", "OneBitLamb"])
def test_one_bit_optimizers_warm_up_exactly_then_compress_and_converge(pools, name):
    results = pools.run(2, _train_rank, name, 2)
    one, = pools.run(1, _train_rank, name, 1)            # the same class, one process, the whole batch
    full, = pools.run(1, _train_rank, FULL_PRECISION[name], 1)
    losses = [(a + b) / 2 for a, b in zip(results[0][0], results[1][0])]
    warm = 120 if name == "OneBitLamb" else 80    # LAMB's frozen trust ratios want a longer warm-up
    # in full precision: 1-bit Adam and LAMB's whole warm-up; 0/1 Adam's steps before the variance's interval
    # first doubles (its steps between variance updates already average compressed gradients)
    exact = 16 if name == "ZeroOneAdam" else warm
    assert losses[:exact] == pytest.approx(one[0][:exact], rel=1e-5)
    traffic = results[0][1]
    assert max(traffic[warm + 2:]) < traffic[5] / 8                    # then 1-bit: under 1/8 of the bytes
    agree = results[0][2]
    assert all(agree[:warm])
    if name == "ZeroOneAdam":
        assert sum(agree[warm:]) >= len(agree[warm:]) // 4            # equal at every sync of the local steps
    else:
        assert all(agree)
    final, reference = sum(losses[-20:]) / 20, sum(full[0][-20:]) / 20
    assert final < losses[0] / 10 and final < 2.5 * reference


def test_one_bit_configs_of_deepspeedexamples_build_and_zero_above_0_is_refused():
    import bunsan
    raw = {"train_batch_size": 4, "optimizer": {"type": "OnebitAdam", "params": {
        "lr": 4e-4, "weight_decay": 0.01, "bias_correction": False, "freeze_step": 23000, "cuda_aware": False,
        "comm_backend_name": "nccl"}}, "gradient_clipping": 1.0, "fp16": {"enabled": True, "loss_scale": 0}}
    assert Config.load(raw).optimizer.type == "OneBitAdam"
    engine = bunsan.initialize(_net(), raw)
    assert type(engine.optimizer).__name__ == "OneBitAdam" and engine.optimizer.freeze_step == 23000
    with pytest.raises(Exception, match="OneBitAdam cannot step here"):
        bunsan.initialize(_net(), {**raw, "fp16": {"enabled": False}, "zero_optimization": {"stage": 1}})
