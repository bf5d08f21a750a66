"""Context parallelism against the plain single-process loop, from the same weights and data: fp32, rtol 1e-5,
SGD without clipping (a gradient-scale error shows) and one AdamW case. The tiny preset has grouped-query
attention (2 key/value heads for 4 query heads) and every case runs the causal mask; a row's tokens are cut
into 2 x cp balanced chunks, and a length that does not cut so is refused.
"""

from __future__ import annotations

import pytest
import torch

from parity import Setup, assert_parity, compare_losses, compare_states, reference_for, reference_model, \
    sgd_no_clip, train

ROWS, SEQ = 4, 16


def layout(cp=2, dp=1, tp=1, sp=False, pp=1, m=1, stage=0, steps=2, overrides=None, recompute="none",
           ignore_frac=0.0, lora=False, offload=0, schedule="1f1b", v=1):
    cfg = {"train_micro_batch_size_per_gpu": ROWS // (dp * m), "gradient_accumulation_steps": m,
           "context_parallel": {"size": cp}, "tensor_parallel": {"size": tp, "sequence_parallel": sp},
           "pipeline": {"stages": pp, "schedule": schedule, "virtual_stages": v},
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 50_000,
                                 "stage3_param_persistence_threshold": 0},
           "activation_checkpointing": {"mode": recompute, "offload_blocks": offload}, "data": {"seq_len": SEQ}, "train": {"timeout_s": 60}}
    if lora:
        cfg["lora"] = {"enabled": True, "r": 4, "alpha": 8.0, "dropout": 0.0,
                       "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}
    return cp * dp * tp * pp, cfg, Setup(steps=steps, rows=ROWS, seq=SEQ, overrides=overrides or {},
                                         ignore_frac=ignore_frac)


LAYOUTS = {
    "cp2": layout(cp=2, steps=3),
    "cp4": layout(cp=4),
    # labels -100 in different numbers on each rank's chunks: the loss is the global token mean
    "cp2-dp2-ignored-labels": layout(cp=2, dp=2, ignore_frac=0.3),
    "cp2-accum2": layout(cp=2, m=2),
    "cp2-zero3": layout(cp=2, stage=3),
    "cp2-dp2-zero2": layout(cp=2, dp=2, stage=2),
    "cp2-tp2": layout(cp=2, tp=2),
    "cp2-tp2-sp": layout(cp=2, tp=2, sp=True),
    "cp2-head-dim-apart": layout(cp=2, overrides={"head_dim": 48}),     # not hidden / heads = 32
    # recomputed blocks all-gather K/V again in backward, in the same order on every rank
    "cp2-full-recompute": layout(cp=2, recompute="full"),
    "cp2-selective-recompute": layout(cp=2, recompute="selective"),
    "cp2-lora": layout(cp=2, lora=True),
    "cp2-offload-activations": layout(cp=2, offload=2),
    "cp2-pp2": layout(cp=2, pp=2, m=2, overrides={"tie_word_embeddings": True}),
    "cp2-pp2-interleaved": layout(cp=2, pp=2, m=4, schedule="interleaved", v=2),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_context_parallel_with_unclipped_sgd_matches_single_process(pools, name):
    world, cfg, setup = LAYOUTS[name]
    cfg = sgd_no_clip(cfg)
    ref = reference_for(cfg, setup)
    doubled = reference_for(cfg, setup, grad_scale=2.0)
    assert compare_states(doubled[1], ref[1]) is not None and compare_losses(doubled[0], ref[0]) is not None
    init = {k: v.detach().numpy() for k, v in reference_model(setup, cfg.get("lora")).state_dict().items()}
    assert_parity(pools.run(world, train, world, cfg, setup), ref, init=init, what=name)


def test_context_parallel_with_adamw_matches_single_process(pools):
    world, cfg, setup = layout(cp=2, stage=1)
    cfg = {**cfg, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01, "eps": 1e-5}},
           "gradient_clipping": 1.0}
    assert_parity(pools.run(world, train, world, cfg, setup), reference_for(cfg, setup), what="cp2 adamw")


def refused(rank: int, world: int, cfg: dict, batch: dict) -> str:
    import bunsan
    from parity import tiny_model
    engine = bunsan.initialize(tiny_model(), cfg)
    try:
        engine.train_batch(batch)
    except ValueError as e:
        return str(e)
    return "trained"


def test_a_length_that_does_not_cut_into_2cp_chunks_is_refused_naming_the_rule(pools):
    world, cfg, _ = layout(cp=2)
    ids = torch.randint(0, 256, (ROWS, 10))          # 10 tokens: not a multiple of 2 x 2
    msgs = pools.run(world, refused, world, cfg, {"input_ids": ids, "labels": ids})
    for msg in msgs:
        assert "sequence length 10" in msg and "2 x context_parallel.size = 4" in msg and "8 or 12" in msg


def test_bunsan_train_refuses_a_seq_len_that_does_not_cut():
    from bunsan.config.root import Config
    from bunsan.training.loop import model_config
    cfg = Config.load({"context_parallel": {"size": 3}, "data": {"seq_len": 20}, "model": {"preset": "tiny"}})
    with pytest.raises(ValueError, match=r"sequence length 20 .* 2 x context_parallel.size = 6.*18 or 24"):
        model_config(cfg, 256)


def test_positions_of_the_balanced_split():
    from bunsan.context_parallel import shard_positions, shard_sequence
    assert shard_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert shard_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    x = torch.arange(16).view(1, 16)
    pieces = [shard_sequence(x, 4, r) for r in range(4)]
    assert pieces[0].tolist() == [[0, 1, 14, 15]] and pieces[3].tolist() == [[6, 7, 8, 9]]
    assert sorted(torch.cat(pieces, 1).flatten().tolist()) == list(range(16))


def hf_refused(rank: int, world: int, cfg: dict) -> str:
    import bunsan
    try:
        bunsan.initialize(torch.nn.Sequential(torch.nn.Linear(4, 4)), cfg)
    except ValueError as e:
        return str(e)
    return "initialized"


def test_a_model_other_than_bunsans_llama_is_refused_at_initialize(pools):
    world, cfg, _ = layout(cp=2)
    for msg in pools.run(world, hf_refused, world, cfg):
        assert "context_parallel.size 2 with a Sequential" in msg and "bunsan's own Llama" in msg


def test_compile_with_context_parallelism_is_refused():
    from bunsan.config.root import Config, ConfigError
    with pytest.raises(ConfigError, match="train.compile with context_parallel.size 2"):
        Config.load({"context_parallel": {"size": 2}, "train": {"compile": True}})


def checkpointed(rank: int, world: int, cfg: dict, root: str, mode: str):
    """'save': 2 steps then a checkpoint; 'load': other weights, the checkpoint, 2 more steps."""
    import bunsan
    from parity import batches, rank_slice, tiny_model, to_numpy
    engine = bunsan.initialize(tiny_model(seed=7 if mode == "load" else 0), cfg)
    data = batches(4, ROWS, SEQ)
    if mode == "load":
        engine.load_checkpoint(root)
    steps = range(0, 2) if mode == "save" else range(2, 4)
    losses = [engine.train_batch(rank_slice(data[s], engine.dp_rank, engine.dp_size)) for s in steps]
    if mode == "save":
        engine.save_checkpoint(root)
    return losses, to_numpy(engine.consolidated_state_dict())


@pytest.mark.parametrize("save_cp,save_zero,load_cp,load_zero", [(2, 0, 1, 0), (1, 0, 2, 1), (2, 1, 2, 3)])
def test_checkpoints_move_between_context_parallel_and_other_layouts(pools, tmp_path, save_cp, save_zero,
                                                                       load_cp, load_zero):
    from parity import batches, reference_train, tiny_model

    def cfg(cp, zero):
        _, c, _ = layout(cp=max(cp, 1), stage=zero)
        return sgd_no_clip({**c, "context_parallel": {"size": cp}}, momentum=0.9)
    first = pools.run(save_cp, checkpointed, save_cp, cfg(save_cp, save_zero), str(tmp_path), "save")
    second = pools.run(load_cp, checkpointed, load_cp, cfg(load_cp, load_zero), str(tmp_path), "load")
    ref = reference_train(tiny_model(0), batches(4, ROWS, SEQ), cfg(1, 0)["optimizer"])
    assert_parity([(first[0][0] + run[0], run[1]) for run in second], ref)


# -- the estimator and the cost model ----------------------------------------------------------------------
def saved_bytes(model, ids) -> float:
    """Bytes of the distinct storages autograd saves in forward, parameters and buffers excluded."""
    skip = {t.untyped_storage().data_ptr() for t in list(model.parameters()) + list(model.buffers())}
    seen = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in skip:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        # detached: a node's own output packed as itself would hold the node (a cycle through C++ that the
        # garbage collector cannot see, keeping the graph and the rings of its collectives); no backward runs
        return t.detach()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(ids)
    return sum(seen.values())


def block_saved(rank: int, world: int, b: int, seq: int) -> tuple[float, float]:
    """(measured, estimated) bytes one block saves on this context-parallel rank."""
    from bunsan.comm import Comm, Mesh
    from bunsan.context_parallel import CPContext, apply_context_parallel, shard_sequence
    from bunsan.estimator.activations import Micro, block_bytes
    from bunsan.models import Llama, build_config
    mesh, comm = Mesh.create(cp=world), Comm(timeout_s=60)
    ids = shard_sequence(torch.randint(0, 256, (b, seq), generator=torch.Generator().manual_seed(0)), world, rank)
    measured = []
    for layers in (3, 1):
        cfg = build_config("tiny", num_hidden_layers=layers)
        model = Llama(cfg)
        apply_context_parallel(model, CPContext(comm, mesh.cp_group, cfg))
        measured.append(saved_bytes(model, ids))
    return (measured[0] - measured[1]) / 2, block_bytes(cfg, Micro(b, seq // world, 4, device="cpu", cp=world))


def test_the_activation_estimate_of_a_block_matches_what_it_saves_under_context_parallelism(pools):
    for measured, estimated in pools.run(2, block_saved, 2, 2, 16):
        assert measured == pytest.approx(estimated)


def test_the_estimator_prices_context_parallel_shares_and_traffic():
    from bunsan.config.root import Config
    from bunsan.estimator import estimate
    from bunsan.estimator.layout import Layout
    from bunsan.planner.cost import cp_kv_bytes, step_time
    from bunsan.estimator.hardware import GPUS, INTERCONNECTS
    from bunsan.models import build_config
    base = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}, "data": {"seq_len": 8192}}
    one = estimate("1b", base, gpus=2)
    two = estimate("1b", {**base, "context_parallel": {"size": 2}}, gpus=2)
    assert two.layout.cp == 2 and two.layout.dp == 1 and "cp2" in two.layout.describe()
    assert Layout.from_config(Config.load(two.layout.to_config(base)), 2) == two.layout
    one_act, two_act = (next(i.device for i in e.items if i.name == "activations") for e in (one, two))
    assert two_act < 0.6 * one_act            # half the tokens each, the whole row's K/V kept
    mask = next(i.device for i in two.items if i.name == "context-parallel mask")
    assert mask == 2048 * (2048 + 4 * 2048) * 4   # chunks 0 and 3 of 2048 tokens against 1 and 4 chunks of keys
    assert two.model_states == one.model_states   # ZeRO-3 shards over dp x cp = dp 2's
    c = build_config("1b")
    lay = Layout(cp=4, seq_len=8192, precision="bf16")
    assert cp_kv_bytes(c, lay) == 3 / 4 * 2 * 8192 * c.num_key_value_heads * c.head_dim * 2
    links = (GPUS["h100"], INTERCONNECTS["nvlink"], INTERCONNECTS["infiniband"], 8)
    t = step_time(c, lay, *links)
    assert t.cp_comm > 0 and "cp_comm" in t.explain() and "cp: per layer" in t.explain()
    assert step_time(c, lay.replace(cp=1), *links).cp_comm == 0
    with pytest.raises(ValueError, match="seq_len 102 is not divisible by 2 x cp = 4"):
        Layout(cp=2, seq_len=102)


def evaluated(rank: int, world: int, cfg: dict, batch: dict):
    """(eval_batch's loss, what engine(inputs) says) on this rank."""
    import bunsan
    from parity import rank_slice, tiny_model
    engine = bunsan.initialize(tiny_model(), cfg)
    loss = engine.eval_batch(rank_slice(batch, engine.dp_rank, engine.dp_size))
    try:
        engine(batch["input_ids"])
        refusal = "ran"
    except RuntimeError as e:
        refusal = str(e)
    return loss, refusal


@pytest.mark.parametrize("shape", [dict(dp=2), dict(pp=2, m=2)], ids=["cp2-dp2", "cp2-pp2"])
def test_eval_batch_is_the_token_mean_and_the_deepspeed_loop_is_refused(pools, shape):
    import torch.nn.functional as F
    from parity import batches, tiny_model
    world, cfg, _ = layout(cp=2, **shape)
    batch = batches(1, ROWS, SEQ, ignore_frac=0.3)[0]
    with torch.no_grad():
        logits = tiny_model()(batch["input_ids"])
    want = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1), ignore_index=-100)
    for loss, refusal in pools.run(world, evaluated, world, cfg, batch):
        assert loss == pytest.approx(want.item(), rel=1e-5)
        assert "context parallelism" in refusal and "engine.train_batch(batch)" in refusal


def test_bf16_under_context_parallelism_tracks_the_fp32_loop(pools):
    world, cfg, setup = layout(cp=2)
    cfg = {**sgd_no_clip(cfg), "bf16": {"enabled": True}}
    ref_losses, _ = reference_for(cfg, setup)
    for run in pools.run(world, train, world, cfg, setup):
        assert compare_losses(run.losses, ref_losses, rtol=2e-2) is None


def test_the_mesh_puts_cp_just_outside_tp_and_reduces_gradients_over_dp_x_cp():
    from bunsan.comm.mesh import Mesh
    groups = {axis: Mesh._groups(2, 2, 2, 2, axis) for axis in ("tp", "cp", "dp", "pp", "dpcp")}
    assert groups["tp"][:2] == [[0, 1], [2, 3]]                    # rank = ((p * dp + d) * cp + c) * tp + t
    assert groups["cp"][:2] == [[0, 2], [1, 3]]
    assert groups["dp"][:2] == [[0, 4], [1, 5]]
    assert groups["pp"][0] == [0, 8]
    assert groups["dpcp"][:2] == [[0, 2, 4, 6], [1, 3, 5, 7]]      # the same weights: gradients and ZeRO shards
    assert Mesh._groups(2, 2, 1, 2, "dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]   # without cp: as before


def test_bunsan_train_with_cp(pools, tmp_path):
    import inspect
    import json
    (tmp_path / "code.py").write_text(inspect.getsource(json))
    ranks = pools.cli(2, ["train", "--nproc", "2", "--cp", "2", "--preset", "tiny", "--steps", "2", "--micro-batch",
                          "2", "--seq-len", "64", "--data", tmp_path / "code.py", "--output", tmp_path / "out",
                          "--set", f"data.cache_dir={tmp_path / 'cache'}"], cwd=tmp_path)
    assert [r.returncode for r in ranks] == [0, 0], ranks
    assert "cp=2" in "".join(r.stdout + r.stderr for r in ranks)
    meta = json.loads((tmp_path / "out" / "final" / "bunsan.json").read_text())
    assert meta["bunsan_config"]["context_parallel"] == {"size": 2}


def held_per_block_selective(rank: int, world: int, ops: list, ids) -> float:
    import bunsan
    from bunsan.context_parallel import shard_sequence
    from bunsan.memory.held import held_for_backward
    from bunsan.models import Llama, build_config
    held = []
    for layers in (1, 3):
        torch.manual_seed(0)
        engine = bunsan.initialize(Llama(build_config("tiny", num_hidden_layers=layers)), {
            "train_micro_batch_size_per_gpu": 1, "context_parallel": {"size": world},
            "activation_checkpointing": {"mode": "selective", "recompute": ops}})
        mine = shard_sequence(ids, world, rank)
        logits, alive = held_for_backward(lambda: engine.module(mine))
        held.append(alive.get("cpu", 0))
        logits.float().sum().backward()
    return (held[1] - held[0]) / 2


@pytest.mark.parametrize("ops", [["attention", "swiglu"], []], ids=["both", "none"])
def test_selective_recompute_under_context_parallelism_keeps_what_the_estimator_prices(pools, ops):
    """Whatever selective keeps, the gathered K/V are not among it: recomputing the block gathers them again."""
    from bunsan.estimator.activations import Micro
    from bunsan.estimator.recompute import selective_kept
    from bunsan.models import build_config
    b, s = 2, 32
    ids = torch.randint(0, 256, (b, s), generator=torch.Generator().manual_seed(0))
    want = sum(selective_kept(build_config("tiny"), Micro(b, s // 2, 4, device="cpu", cp=2), ops).values())
    assert pools.run(2, held_per_block_selective, 2, ops, ids) == [want, want]
