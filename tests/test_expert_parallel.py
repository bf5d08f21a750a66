"""Expert parallelism (bunsan/expert_parallel/, zero/experts.py) against the plain single-process loop: a MoE
Llama trained with plain SGD, no clipping, fp32, from the same weights on the same data; losses and final
weights within rtol 1e-5.

The plain loop runs each rank's rows (and each micro-batch) as its own forward, as the ranks do: the auxiliary
loss and the capacity are functions of the tokens one forward routes, so that is what a data-parallel MoE run
computes. Its balancing losses enter the gradient through the block's aux_grad_scale, 1 / the number of
forwards per step: the mean over micro-batches and replicas the engine gives.

Cases kept (each adds what the others do not):

| case                     | ranks | what it proves                                                              |
|--------------------------|-------|-----------------------------------------------------------------------------|
| dp2 (no EP)              | 2     | a MoE model under plain DP, the balancing loss through aux_grad_scale       |
| ep2                      | 2     | tokens to their experts' rank and back; experts' gradients not reduced      |
| ep2-zero1, ep2-zero2     | 2     | the experts' strategy sharded (over a group of one) beside the dense one    |
| ep2-zero3                | 2     | ZeRO-3: each experts module gathered as a unit of its own                   |
| ep2-full-recompute       | 2     | blocks recomputed in backward: their all-to-alls run again, alike on ranks  |
| ep2-dp4                  | 4     | expert-data-parallel reduction (each expert on 2 replicas)                  |
| ep2-dp4-zero3-accum2     | 4     | the experts' ZeRO-3 shards over their replicas, with accumulation           |
| ep2-tp2-zero3            | 4     | EP x TP x ZeRO-3                                                            |
| ep4-dp4-accum2           | 4     | one expert per rank, 2 micro-batches                                        |
| ep2-pp2                  | 4     | EP inside pipeline stages, their micro-batches                              |
| ep2-cp2                  | 2     | EP folded over context-parallel ranks                                       |
| ep2-idle-expert          | 2     | an expert no token chooses (its weights get a zero gradient, no hang)       |
| ep2-idle-rank            | 2     | a rank whose experts no token chooses                                       |
| ep2-zero3-idle-rank      | 2     | that under ZeRO-3: the idle rank's experts still gathered, nobody waits     |
| ep2-capacity             | 2     | capacity dropping (per forward, as the plain loop)                          |
| ep2-deepseek-v3          | 2     | sigmoid, groups, shared experts, the expert-bias update, z-loss             |
| tp2                      | 2     | every expert's width split; router whole, its gradient summed               |
| tp2-sp-deepseek-v3       | 2     | the same under SP (sequence gathered in, reduce-scattered out), shared      |
|                          |       | experts split, the balancing losses' gradient shared over the TP ranks      |
| ep2-tp2                  | 4     | experts split over EP (dim 0) and TP (their width) at once                  |
| ep2-tp2-sp-zero1         | 4     | that under SP with the experts' ZeRO-1                                      |
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from parity import SGD_LR, batches, compare_losses, compare_states, rank_slice, sgd_no_clip, to_numpy

from bunsan.models.llama import Llama
from bunsan.models.moe import MoE
from bunsan.models.presets import get_preset

STEPS, ROWS, SEQ = 3, 8, 16
MIXTRAL = {"num_experts": 4, "top_k": 2, "expert_intermediate_size": 64, "route_norm": True, "aux_loss_coef": 0.01}
DEEPSEEK_V3 = {"num_experts": 4, "top_k": 2, "expert_intermediate_size": 32, "score_func": "sigmoid",
               "n_groups": 2, "topk_groups": 1, "num_shared_experts": 1, "route_scale": 2.5,
               "expert_bias_update_rate": 0.01, "z_loss_coef": 0.001}
IDLE_EXPERT = [0.0, 0.0, 0.0, -100.0]         # expert 3 never chosen
IDLE_RANK = [0.0, 0.0, -100.0, -100.0]        # rank 1's experts (2 and 3) never chosen


def moe_model(moe: dict, bias: list | None = None) -> Llama:
    torch.manual_seed(0)
    model = Llama(get_preset("tiny").replace(moe=moe, num_hidden_layers=2))
    if bias is not None:
        with torch.no_grad():
            for m in model.modules():
                if isinstance(m, MoE):
                    m.expert_bias.copy_(torch.tensor(bias))
    return model


def layout(dp=2, ep=2, stage=0, m=1, pp=1, cp=1, tp=1, sp=False, moe=None, bias=None, recompute=None,
           compile=False):
    cfg = {"train_micro_batch_size_per_gpu": ROWS // (dp * m), "gradient_accumulation_steps": m,
           "activation_checkpointing": {"mode": recompute or "none"},
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 50_000},
           "pipeline": {"stages": pp}, "context_parallel": {"size": cp},
           "tensor_parallel": {"size": tp, "sequence_parallel": sp},
           "expert_parallel": {"enabled": ep > 1, "autoep_size": ep}, "train": {"timeout_s": 60, "compile": compile}}
    return dp * pp * cp * tp, sgd_no_clip(cfg), moe or MIXTRAL, bias


CASES = {
    "dp2": layout(ep=1),
    "ep2": layout(),
    "ep2-zero1": layout(stage=1),
    "ep2-zero2": layout(stage=2),
    "ep2-zero3": layout(stage=3),
    "ep2-full-recompute": layout(recompute="full"),
    "ep2-dp4-zero3-accum2": layout(dp=4, stage=3, m=2),
    "ep2-tp2-zero3": layout(tp=2, stage=3),
    "ep2-dp4": layout(dp=4),
    "ep4-dp4-accum2": layout(dp=4, ep=4, m=2),
    "ep2-pp2": layout(pp=2, m=2),
    "ep2-cp2": layout(dp=1, cp=2, moe={**MIXTRAL, "aux_loss_coef": 0.0}),
    "ep2-idle-expert": layout(bias=IDLE_EXPERT),
    "ep2-idle-rank": layout(bias=IDLE_RANK),
    "ep2-zero3-idle-rank": layout(stage=3, bias=IDLE_RANK),
    "ep2-capacity": layout(moe={**MIXTRAL, "capacity_factor": 0.75}),
    "ep2-deepseek-v3": layout(moe=DEEPSEEK_V3),
    "tp2": layout(dp=1, ep=1, tp=2),
    "tp2-sp-deepseek-v3": layout(dp=1, ep=1, tp=2, sp=True, moe=DEEPSEEK_V3),
    "ep2-tp2": layout(tp=2),
    "ep2-tp2-sp-zero1": layout(tp=2, sp=True, stage=1),
}


def data() -> list[dict]:
    return batches(STEPS, ROWS, SEQ)


def train(rank: int, world: int, cfg: dict, moe: dict, bias: list | None):
    """Worker: the MoE Llama under `cfg`, STEPS global batches; (losses, consolidated state, metrics, comm)."""
    import bunsan
    engine = bunsan.initialize(moe_model(moe, bias), cfg)
    losses = [engine.train_batch(rank_slice(b, engine.dp_rank, engine.dp_size)) for b in data()]
    return losses, to_numpy(engine.consolidated_state_dict()), engine.moe.metrics(), engine.comm_stats()


def reference(moe: dict, bias: list | None, forwards: int, grad_scale: float = 1.0):
    """The plain loop: each step's rows in `forwards` equal pieces (ranks x micro-batches, in row order), each
    its own forward; mean token loss of the whole batch; SGD; the expert bias moved after the step."""
    model = moe_model(moe, bias)
    blocks = [m for m in model.modules() if isinstance(m, MoE)]
    for b in blocks:
        b.aux_grad_scale = grad_scale / forwards
    opt = torch.optim.SGD(model.parameters(), lr=SGD_LR)
    losses = []
    for batch in data():
        n = (batch["labels"] != -100).sum()
        total = 0.0
        for piece in range(forwards):
            mb = rank_slice(batch, piece, forwards)
            logits = model(mb["input_ids"])
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), mb["labels"].reshape(-1),
                                   ignore_index=-100, reduction="sum") / n
            (loss * grad_scale).backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        for b in blocks:
            if b.config.expert_bias_update_rate:
                b.update_expert_bias()
            else:
                b.take_expert_counts()
        losses.append(total)
    return losses, to_numpy(model.state_dict())


@pytest.mark.parametrize("name", list(CASES))
def test_expert_parallel_matches_the_plain_loop(pools, name):
    world, cfg, moe, bias = CASES[name]
    forwards = world // (cfg["pipeline"]["stages"] * cfg["context_parallel"]["size"]
                         * cfg["tensor_parallel"]["size"]) * cfg["gradient_accumulation_steps"]
    if cfg["context_parallel"]["size"] > 1:
        forwards = 1      # no balancing loss, dropless: routing is per token, the rows may go in one forward
    ref = reference(moe, bias, forwards)
    runs = pools.run(world, train, world, cfg, moe, bias)
    for r, (losses, state, _, _) in enumerate(runs):
        problem = compare_losses(losses, ref[0], what=f"{name} rank {r}: ") or \
            compare_states(state, ref[1], what=f"{name} rank {r}: ")
        assert problem is None, problem
    if name == "ep2":     # the comparison tells a uniform gradient-scale error apart
        doubled = reference(moe, bias, forwards, grad_scale=2.0)
        assert compare_states(doubled[1], ref[1]) is not None


def test_idle_experts_keep_their_weights_and_are_reported(pools):
    """An expert no token chooses gets no update; the load metric says the busiest expert had twice the
    mean share (two of four experts take everything)."""
    world, cfg, moe, bias = CASES["ep2-idle-rank"]
    runs = pools.run(world, train, world, cfg, moe, bias)
    init = to_numpy(moe_model(moe, bias).state_dict())
    state, metrics = runs[0][1], runs[0][2]
    for layer in range(2):
        w1 = state[f"layers.{layer}.mlp.experts.w1"]
        np.testing.assert_array_equal(w1[2:], init[f"layers.{layer}.mlp.experts.w1"][2:])
        assert not np.array_equal(w1[:2], init[f"layers.{layer}.mlp.experts.w1"][:2])
        assert metrics[f"moe/layers.{layer}.mlp/load_max_over_mean"] >= 2.0
        assert metrics[f"moe/layers.{layer}.mlp/dropped_fraction"] == 0.0


def test_tokens_cross_ranks_by_all_to_all(pools):
    """Every MoE block's forward and backward move tokens by uneven all-to-all over the expert group; without
    EP there is none."""
    world, cfg, moe, bias = CASES["ep2"]
    stats = pools.run(world, train, world, cfg, moe, bias)[0][3]["step"]
    moved = {k: v for k, v in stats.items() if k.startswith("all_to_all_v/")}
    assert list(moved) == ["all_to_all_v/ep"], stats
    assert moved["all_to_all_v/ep"]["calls"] == 2 * 2 * 2      # 2 blocks x (there and back) x (fwd and bwd)
    assert moved["all_to_all_v/ep"]["bytes"] > 0
    world, cfg, moe, bias = CASES["dp2"]
    stats = pools.run(world, train, world, cfg, moe, bias)[0][3]["step"]
    assert not any(k.startswith("all_to_all") for k in stats)


def test_under_tensor_parallelism_each_rank_dispatches_its_slice_of_the_rows(pools):
    """EP 2 x TP 2 routes the rows EP 2 alone does (the same data-parallel ranks) but each tensor-parallel rank
    sends its half of them over the expert group: the all-to-alls carry half the bytes per rank (a row or two
    apart: each expert's run is cut in near halves), and the tensor-parallel group gathers and scatters the rest."""
    def moved(name):
        world, cfg, moe, bias = CASES[name]
        runs = pools.run(world, train, world, cfg, moe, bias)
        return [r[3]["step"] for r in runs]
    alone, both = moved("ep2"), moved("ep2-tp2")
    per_rank = sum(s["all_to_all_v/ep"]["bytes"] for s in alone) / len(alone)
    sliced = sum(s["all_to_all_v/ep"]["bytes"] for s in both) / len(both)
    assert sliced == pytest.approx(per_rank / 2, rel=0.1), (sliced, per_rank)
    assert all(s["all_gather/tp"]["bytes"] > 0 and s["reduce_scatter/tp"]["bytes"] > 0 for s in both)


def test_compiled_blocks_with_the_experts_eager_train_as_uncompiled_ones_do(pools):
    """train.compile: each block compiled, its experts (and under EP their all-to-all) run eagerly inside it. Inductor
    fuses the rest its own way, so the compiled runs are held to each other (DP 2 and EP 2: the same compiled
    graphs) and to the plain loop's first loss at inductor's tolerance."""
    runs = {}
    for name, ep in (("dp2", 1), ("ep2", 2)):
        world, cfg, moe, bias = layout(ep=ep, compile=True)
        runs[name] = pools.run(world, train, world, cfg, moe, bias)[0]
    ref = reference(MIXTRAL, None, 2)
    assert runs["dp2"][0][0] == pytest.approx(ref[0][0], rel=1e-4)
    problem = compare_losses(runs["ep2"][0], runs["dp2"][0], what="ep2 vs dp2 compiled: ") or \
        compare_states(runs["ep2"][1], runs["dp2"][1], what="ep2 vs dp2 compiled: ")
    assert problem is None, problem
