"""DeepSpeed's MoE API on bunsan (`bunsan.deepspeed.moe`), in the user's form: a script's Net with
`deepspeed.moe.layer.MoE(hidden_size, expert=nn.Linear(...), num_experts, ep_size, k, ...)`, its optimizer
groups from `split_params_into_different_moe_groups_for_optimizer`, `deepspeed.initialize(model=,
model_parameters=, config=)`, `engine(x)` / `engine.backward(loss)` / `engine.step()`.

Every layout against the plain single-process loop (one process, ep_size 1, each rank's rows its own forward,
as the capacity is per forward): fp32, SGD without clipping, rtol 1e-5. Deterministic gating (no noise, no
random token selection) there; the noise policies are checked for what they draw. The curves against
DeepSpeed 0.19.8 itself are benchmarks/bench_deepspeed_moe.py's.

| case            | what it adds                                                                  |
|-----------------|-------------------------------------------------------------------------------|
| top1-ep2        | run_ds_moe.sh's layer: 2 experts, one per rank, capacity drops                |
| top2-ep2        | 4 experts, second choices ranked after first choices                          |
| top3-ep2        | k > 2 (DeepSpeed's topkgating), weights renormalised over the kept            |
| residual-ep2    | PR-MoE (use_residual): the dense expert and the mixing coefficient           |
| dropless-ep2    | drop_tokens False: the capacity all-reduced (MAX) over the expert group      |
| top1-ep2-zero2  | the experts' strategy at ZeRO-2 beside the dense one                          |
| top2-ep2-zero3  | ZeRO-3: the layer's experts container gathered as a unit of its own          |
| top2-ep1        | ep_size 1: experts replicated, plain data parallelism                          |
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import bunsan.deepspeed as deepspeed
from bunsan.deepspeed.moe.layer import MoE
from bunsan.deepspeed.moe.utils import is_moe_param, split_params_into_different_moe_groups_for_optimizer

ROWS, STEPS, LR = 16, 3, 0.1


class Net(nn.Module):
    """A cifar10_deepspeed.py-shaped model: dense layers, MoE layers of an nn.Linear expert, a head."""

    def __init__(self, ep: int, layers: tuple[int, ...] = (2,), **moe):
        super().__init__()
        self.fc1 = nn.Linear(12, 16)
        expert = nn.Linear(16, 16)
        self.moe_layer_list = nn.ModuleList(
            deepspeed.moe.layer.MoE(hidden_size=16, expert=expert, num_experts=n, ep_size=ep, **moe) for n in layers)
        self.fc4 = nn.Linear(16, 5)

    def forward(self, x):
        x = F.relu(self.fc1(x))
        for layer in self.moe_layer_list:
            x, _, _ = layer(x)
        return self.fc4(x)


DETERMINISTIC = {"min_capacity": 0, "use_rts": False, "top2_2nd_expert_sampling": False}
CASES = {
    "top1-ep2": (2, (2,), {"k": 1}, 0),
    "top2-ep2": (2, (4,), {"k": 2}, 0),
    "top3-ep2": (2, (4,), {"k": 3}, 0),
    "residual-ep2": (2, (2, 4), {"k": 1, "use_residual": True}, 0),
    "dropless-ep2": (2, (4,), {"k": 2, "drop_tokens": False}, 0),
    "top1-ep2-zero2": (2, (2,), {"k": 1}, 2),
    "top2-ep2-zero3": (2, (4,), {"k": 2}, 3),
    "top2-ep1": (1, (4,), {"k": 2}, 0),
}


def build(ep, layers, moe) -> Net:
    torch.manual_seed(0)
    return Net(ep, layers, **DETERMINISTIC, **moe)


def data():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(ROWS, 12, generator=g), torch.randint(0, 5, (ROWS,), generator=g)) for _ in range(STEPS)]


def config(stage: int) -> dict:
    return {"train_batch_size": ROWS, "optimizer": {"type": "SGD", "params": {"lr": LR}},
            "zero_optimization": {"stage": stage}, "train": {"timeout_s": 60}}


def train(rank: int, ep, layers, moe, stage):
    """Worker: the script's loop; per step the loss averaged over the ranks, and the consolidated weights."""
    net = build(ep, layers, moe)
    groups = split_params_into_different_moe_groups_for_optimizer({"params": list(net.parameters()),
                                                                   "name": "parameters"})
    engine, _, _, _ = deepspeed.initialize(model=net, model_parameters=groups, config=config(stage))
    losses = []
    for x, y in data():
        n = ROWS // 2
        loss = F.cross_entropy(engine(x[rank * n:(rank + 1) * n]), y[rank * n:(rank + 1) * n])
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        deepspeed.comm.all_reduce(total)
        losses.append(total.item() / 2)
    return losses, engine.bunsan.consolidated_state_dict()


def reference(layers, moe):
    net = build(1, layers, moe)
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    losses = []
    for x, y in data():
        total = 0.0
        for r in range(2):
            n = ROWS // 2
            loss = F.cross_entropy(net(x[r * n:(r + 1) * n]), y[r * n:(r + 1) * n]) / 2
            loss.backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, net.state_dict()


@pytest.mark.parametrize("name", list(CASES))
def test_deepspeeds_moe_layer_matches_the_plain_loop(pools, name):
    ep, layers, moe, stage = CASES[name]
    ref_losses, ref_state = reference(layers, moe)
    for losses, state in pools.run(2, train, ep, layers, moe, stage):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
        assert state.keys() == ref_state.keys()
        for key, want in ref_state.items():
            torch.testing.assert_close(state[key], want, rtol=1e-5, atol=1e-6, msg=key)


def test_the_layer_keeps_deepspeeds_names_marks_and_result():
    torch.manual_seed(0)
    layer = MoE(hidden_size=8, expert=nn.Linear(8, 8), num_experts=4, k=2, use_residual=True)
    names = set(layer.state_dict())
    assert {"deepspeed_moe.gate.wg.weight", "deepspeed_moe.experts.deepspeed_experts.3.weight", "mlp.weight",
            "coefficient.weight"} <= names
    experts = [p for n, p in layer.named_parameters() if ".deepspeed_experts." in n]
    assert experts and all(is_moe_param(p) and p.group_name == "ep_size_1" for p in experts)
    assert not is_moe_param(layer.deepspeed_moe.gate.wg.weight)
    out, l_aux, exp_counts = layer(torch.randn(3, 5, 8))
    assert out.shape == (3, 5, 8) and l_aux.dim() == 0 and exp_counts.tolist() and int(exp_counts.sum()) == 30


def test_top1_aux_loss_and_counts_are_deepspeeds_formulas():
    """l_aux = E * sum_e mean_s(scores[:, e]) * mean_s(first choice is e); exp_counts before capacity."""
    torch.manual_seed(0)
    layer = MoE(hidden_size=8, expert=nn.Linear(8, 8), num_experts=4, k=1, capacity_factor=0.5, min_capacity=0)
    x = torch.randn(20, 8)
    _, l_aux, counts = layer(x)
    scores = F.softmax(x @ layer.deepspeed_moe.gate.wg.weight.t(), dim=1)
    choice = F.one_hot(scores.argmax(dim=1), 4).float()
    torch.testing.assert_close(l_aux, 4 * (scores.mean(0) * choice.mean(0)).sum())
    assert counts.tolist() == choice.sum(0).long().tolist()


def test_the_param_groups_split_as_deepspeeds():
    torch.manual_seed(0)
    net = Net(1, (2, 4))
    groups = split_params_into_different_moe_groups_for_optimizer({"params": list(net.parameters()),
                                                                   "name": "parameters", "lr": 0.5})
    assert [g["name"] for g in groups] == ["parameters", "ep_size_1"]
    assert groups[1]["moe"] is True and groups[1]["lr"] == 0.5
    assert all(is_moe_param(p) for p in groups[1]["params"])
    assert not any(is_moe_param(p) for p in groups[0]["params"])
    assert len(groups[0]["params"]) + len(groups[1]["params"]) == len(list(net.parameters()))


def test_noise_is_drawn_from_torchs_generator():
    """RSample (top-1) and the sampled second expert (top-2) draw from torch's generator: a run seeded alike
    routes alike, and the noise changes the choices from the plain argmax."""
    def routes(seed, **moe):
        torch.manual_seed(0)
        layer = MoE(hidden_size=8, expert=nn.Linear(8, 8), num_experts=4, min_capacity=0, **moe)
        torch.manual_seed(seed)
        return layer(torch.randn(64, 8))[2]
    assert torch.equal(routes(3, k=1, noisy_gate_policy="RSample"), routes(3, k=1, noisy_gate_policy="RSample"))
    assert torch.equal(routes(3, k=2), routes(3, k=2))
    assert not torch.equal(routes(3, k=2), routes(3, k=2, top2_2nd_expert_sampling=False))


@pytest.mark.parametrize("kwargs, said", [
    ({"num_experts": 3, "ep_size": 2}, "not divisible by ep_size 2"),
    ({"num_experts": 4, "k": 2, "noisy_gate_policy": "RSample"}, "'RSample' noises top-1 gating only"),
    ({"num_experts": 4, "noisy_gate_policy": "Gumbel"}, "noisy_gate_policy 'Gumbel'"),
    ({"num_experts": 4, "enable_expert_tensor_parallelism": True}, "not built"),
    ({"num_experts": 2, "k": 3}, "k 3 exceeds num_experts 2"),
])
def test_bad_arguments_are_refused_naming_them(kwargs, said):
    with pytest.raises(ValueError, match=said):
        MoE(hidden_size=8, expert=nn.Linear(8, 8), **kwargs)


def test_an_ep_layer_called_outside_initialize_says_why():
    layer = MoE(hidden_size=8, expert=nn.Linear(8, 8), num_experts=4, ep_size=2)
    with pytest.raises(RuntimeError, match="no expert-parallel group"):
        layer(torch.randn(4, 8))
