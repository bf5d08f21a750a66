"""Hugging Face causal LMs (tiny configs built locally) on bunsan's layouts against the plain single-process
HF loop: the whole batch dict reaches the model (an attention mask changes the loss), HF's unshifted labels
or pre-shifted shift_labels, the global token mean, ZeRO-3 units and activation checkpointing from
`_no_split_modules`. SGD without clipping, fp32, rtol 1e-5."""

from __future__ import annotations

import pytest
import torch

import bunsan
from parity import check_runs

transformers = pytest.importorskip("transformers")

ROWS, SEQ, VOCAB, STEPS = 4, 12, 64, 3
LR = 0.5


def tiny(arch: str, **extra):
    common = extra | dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
           "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
           "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),   # per-head q_norm / k_norm
           "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM)}[arch.removesuffix("_sliding")]
    if arch.endswith("_sliding"):   # full attention in layer 0, a sliding window of 3 in layer 1
        common |= {"use_sliding_window": True, "sliding_window": 3, "max_window_layers": 1}
    torch.manual_seed(0)
    return cls[1](cls[0](**common))


def data(steps: int = STEPS) -> list[dict]:
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
        mask = torch.ones_like(ids)
        mask[0, :3] = 0      # left padding, of different lengths
        mask[3, :6] = 0
        out.append({"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)})
    return out


def reference(arch: str, batches: list[dict]):
    return reference_from(tiny(arch), batches)


def reference_from(model, batches: list[dict]):
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for b in batches:
        loss = model(**b).loss       # HF's own loss over the whole batch: the global token mean
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.clone() for k, v in model.state_dict().items()}


def _cfg(stage: int, ga: int = 1, ckpt: bool = False) -> dict:
    return {"train_batch_size": ROWS, "gradient_accumulation_steps": ga, "steps_per_print": 100,
            "optimizer": {"type": "SGD", "params": {"lr": LR}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
            "activation_checkpointing": {"enabled": ckpt}}


def _train(rank, world, arch, cfg, batches, key):
    engine = bunsan.initialize(tiny(arch), cfg)
    per = ROWS // world
    losses = []
    for b in batches:
        mine = {k: v[rank * per:(rank + 1) * per] for k, v in b.items()}
        if key == "shift_labels":
            labels = mine.pop("labels")
            mine["shift_labels"] = torch.cat([labels[:, 1:], torch.full((per, 1), -100)], 1)
        losses.append(engine.train_batch(mine))
    units = len(engine.strategy.units) - 1 if hasattr(engine.strategy, "units") else None
    return losses, engine.consolidated_state_dict(), units


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("stage", [0, 3])
def test_hf_model_on_zero_matches_the_hf_loop(pools, arch, stage):
    batches = data()
    results = pools.run(2, _train, 2, arch, _cfg(stage), batches, "labels")
    check_runs(results, *reference(arch, batches))
    if stage == 3:
        assert results[0][2] == 2, "one ZeRO-3 unit per decoder layer (from _no_split_modules)"


def test_accumulation_recompute_and_shift_labels(pools):
    batches = data()
    results = pools.run(2, _train, 2, "llama", _cfg(3, ga=2, ckpt=True), batches, "shift_labels")
    check_runs(results, *reference("llama", batches))


def test_the_mask_reaches_the_model():
    b = data(1)[0]
    engine = bunsan.initialize(tiny("llama"), _cfg(0))
    masked = engine.eval_batch(b)
    unmasked = engine.eval_batch({**b, "attention_mask": torch.ones_like(b["attention_mask"])})
    assert masked != pytest.approx(unmasked, rel=1e-4)
    with torch.no_grad():
        assert masked == pytest.approx(tiny("llama")(**b).loss.item(), rel=1e-5)


def test_a_key_the_model_does_not_take_is_an_error():
    engine = bunsan.initialize(tiny("llama"), _cfg(0))
    b = data(1)[0]
    with pytest.raises(ValueError, match=r"\['token_type_ids'\] are not inputs"):
        engine.train_batch({**b, "token_type_ids": b["input_ids"]})
    with pytest.raises(ValueError, match="exactly one of them"):
        engine.train_batch({"input_ids": b["input_ids"]})


# -- tensor parallelism from the model's own plan ---------------------------------------------------------
def _tp_cfg(tp: int, world: int, sp: bool = False) -> dict:
    return {**_cfg(0), "train_batch_size": ROWS, "tensor_parallel": {"size": tp, "sequence_parallel": sp}}


def _train_tp(rank, world, arch, cfg, batches):
    engine = bunsan.initialize(tiny(arch), cfg)
    dp, dp_rank = engine.mesh.dp, engine.mesh.dp_rank
    per = ROWS // dp
    losses = [engine.train_batch({k: v[dp_rank * per:(dp_rank + 1) * per] for k, v in b.items()})
              for b in batches]
    swapped = sorted({type(m).__name__ for m in engine.module.modules() if hasattr(m, "tp_split")})
    return losses, engine.consolidated_state_dict(), swapped


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2_sp"])
def test_hf_plan_tensor_parallel_matches_the_hf_loop(pools, arch, sp):
    batches = data()
    results = pools.run(2, _train_tp, 2, arch, _tp_cfg(2, 2, sp), batches)
    ref_losses, ref_state = reference(arch, batches)
    check_runs([(r[0], r[1], None) for r in results], ref_losses, ref_state)
    assert results[0][2] == ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
                             "VocabParallelHead"]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_hf_plan_tp2_x_dp2(pools, arch):
    batches = data()
    results = pools.run(4, _train_tp, 4, arch, _tp_cfg(2, 4), batches)
    check_runs([(r[0], r[1], None) for r in results], *reference(arch, batches))


def test_tp_plan_guards():
    from bunsan.comm.collectives import Comm
    from bunsan.comm.work import Group
    from bunsan.tensor_parallel import TPContext, apply_tensor_parallel
    ctx = TPContext(Comm(), Group("tp", None, 1, 0, (0,)))
    with pytest.raises(ValueError, match="match no module"):
        apply_tensor_parallel(tiny("llama"), ctx, {"layers.*.attn.q": "column"})
    with pytest.raises(ValueError, match="unknown tensor-parallel style"):
        apply_tensor_parallel(tiny("llama"), ctx, {"model.layers.*.self_attn.q_proj": "colwise"})
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32))
    with pytest.raises(ValueError, match="ships no tensor-parallel plan"):
        apply_tensor_parallel(gpt2, ctx)
    with pytest.raises(ValueError, match="Conv1D"):
        apply_tensor_parallel(gpt2, ctx, {"transformer.h.*.attn.c_attn": "column"})


# -- pipeline parallelism at the decoder layers ----------------------------------------------------------
def _train_pp(rank, world, arch, cfg, batches):
    engine = bunsan.initialize(tiny(arch), cfg)
    losses = [engine.train_batch(b) for b in batches]
    return losses, engine.consolidated_state_dict(), sorted(n for n, _ in engine.module.named_parameters())


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen2_sliding", "mistral"])
def test_hf_decoder_pipeline_matches_the_hf_loop(pools, arch):
    batches = data()
    cfg = {**_cfg(0, ga=2), "pipeline": {"stages": 2}}
    results = pools.run(2, _train_pp, 2, arch, cfg, batches)
    check_runs([(r[0], r[1], None) for r in results], *reference(arch, batches))
    first, last = results[0][2], results[1][2]
    assert "model.embed_tokens.weight" in first and "lm_head.weight" in last
    assert not any(n.startswith("model.layers.1.") for n in first)


def _train_pp_blocks(rank, world, arch, cfg, batches):
    engine = bunsan.initialize(tiny(arch), cfg)
    losses = [engine.train_batch(b) for b in batches]
    blocks = [m for m in engine.module.modules() if type(m).__name__.endswith("DecoderLayer")]
    wrapped = sum("forward" in b.__dict__ for b in blocks)         # recompute wraps a block's forward
    return losses, engine.consolidated_state_dict(), (len(engine.strategy.units), len(blocks), wrapped)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_hf_decoder_stages_recompute_and_gather_block_by_block(pools, mode):
    """A transformers decoder's pipeline stage finds its blocks as the whole model does (its _no_split_modules):
    recompute wraps each, and ZeRO-3 gathers them one by one. Before, a stage had no blocks: recompute was
    skipped silently and ZeRO-3 gathered the stage whole, against what the estimate prices."""
    batches = data()
    cfg = {**_cfg(3, ga=2), "pipeline": {"stages": 2}, "activation_checkpointing": {"mode": mode}}
    results = pools.run(2, _train_pp_blocks, 2, "qwen2", cfg, batches)
    check_runs([(r[0], r[1], None) for r in results], *reference("qwen2", batches))
    assert [r[2] for r in results] == [(2, 1, 1)] * 2      # the root unit and the stage's one block, recomputed


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_hf_decoder_pp2_x_tp2(pools, arch):
    batches = data()
    cfg = {**_cfg(0, ga=2), "pipeline": {"stages": 2}, "tensor_parallel": {"size": 2}}
    results = pools.run(4, _train_pp, 4, arch, cfg, batches)
    check_runs([(r[0], r[1], None) for r in results], *reference(arch, batches))


def _gpt2():
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB,
                                                                 n_positions=SEQ, resid_pdrop=0.0, embd_pdrop=0.0,
                                                                 attn_pdrop=0.0))


def _train_gpt2(rank, world, cfg, batches):
    engine = bunsan.initialize(_gpt2(), cfg)
    per = ROWS // world
    losses = [engine.train_batch({k: v[rank * per:(rank + 1) * per] for k, v in b.items()}) for b in batches]
    return losses, engine.consolidated_state_dict(), len(engine.strategy.units) - 1


def test_gpt2_on_zero3(pools):
    batches = data()
    results = pools.run(2, _train_gpt2, 2, _cfg(3), batches)
    model = _gpt2()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    ref_losses = []
    for b in batches:
        loss = model(**b).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        ref_losses.append(loss.item())
    check_runs([(r[0], r[1], None) for r in results], ref_losses, model.state_dict())
    assert results[0][2] == 2, "one unit per GPT2Block"


# -- checkpoints between bunsan's Llama and the transformers model ---------------------------------------
def _logits(model, ids):
    with torch.no_grad():
        out = model(ids)
        return (out.logits if hasattr(out, "logits") else out).float()


def test_checkpoints_move_between_bunsan_llama_and_hf(tmp_path):
    from bunsan.checkpoint.convert import convert
    from bunsan.models import Llama, LlamaConfig
    batches = data(2)
    hf_engine = bunsan.initialize(tiny("llama"), _cfg(0))
    for b in batches:
        hf_engine.train_batch(b)
    hf_engine.save_checkpoint(tmp_path / "hf_run")
    ids = batches[0]["input_ids"]
    want = _logits(hf_engine.module, ids)

    llama = bunsan.initialize(Llama(LlamaConfig.from_hf(hf_engine.module.config.to_dict())), _cfg(0))
    llama.load_checkpoint(tmp_path / "hf_run")
    torch.testing.assert_close(_logits(llama.module, ids), want, rtol=1e-5, atol=1e-5)
    assert llama.global_step == 2

    llama.save_checkpoint(tmp_path / "llama_run")       # and back: bunsan's names into the HF model
    back = bunsan.initialize(tiny("llama"), _cfg(0))
    back.load_checkpoint(tmp_path / "llama_run")
    torch.testing.assert_close(_logits(back.module, ids), want, rtol=1e-5, atol=1e-5)

    for arch in ("llama", "qwen2"):                     # bunsan convert --to hf of a transformers model's run
        engine = bunsan.initialize(tiny(arch), _cfg(0))
        engine.train_batch(batches[0])
        engine.save_checkpoint(tmp_path / f"{arch}_run")
        convert(tmp_path / f"{arch}_run", tmp_path / f"{arch}_hf", to="hf")
        loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / f"{arch}_hf").eval()
        torch.testing.assert_close(_logits(loaded, ids), _logits(engine.module, ids), rtol=1e-5, atol=1e-5)


def _train_zero_init(rank, world, cfg, batches):
    import bunsan.deepspeed as deepspeed
    with deepspeed.zero.Init():
        model = tiny("llama")
    assert all(p.is_meta for p in model.parameters())
    inv_freq = model.model.rotary_emb.inv_freq.clone()
    engine = bunsan.initialize(model, cfg)
    per = ROWS // world
    losses = [engine.train_batch({k: v[rank * per:(rank + 1) * per] for k, v in b.items()}) for b in batches]
    return losses, engine.consolidated_state_dict(), inv_freq


def test_hf_model_built_under_zero_init(pools):
    batches = data()
    results = pools.run(2, _train_zero_init, 2, _cfg(3), batches)
    check_runs([(r[0], r[1], None) for r in results], *reference("llama", batches))
    torch.testing.assert_close(results[0][2], tiny("llama").model.rotary_emb.inv_freq)


def _train_bunsan_zero_init(rank, world, cfg, batches, tie):
    from bunsan.zero.slices import slice_of
    torch.manual_seed(0)
    with bunsan.zero.Init():        # meta: each rank keeps its slice, initialised by HF's own _init_weights
        model = tiny("llama", tie_word_embeddings=tie)
    pieces = {n: slice_of(p).piece.numel() for n, p in model.named_parameters()}
    assert all(p.is_meta for p in model.parameters())
    inv_freq = model.model.rotary_emb.inv_freq.clone()
    engine = bunsan.initialize(model, cfg)
    first = engine.consolidated_state_dict()
    per = ROWS // world
    losses = [engine.train_batch({k: v[rank * per:(rank + 1) * per] for k, v in b.items()}) for b in batches]
    return losses, engine.consolidated_state_dict(), inv_freq, first, pieces


@pytest.mark.parametrize("tie", [False, True])
def test_hf_model_built_on_meta_equals_a_normal_build(pools, tie):
    batches = data()
    normal = tiny("llama", tie_word_embeddings=tie)
    built = {k: v.clone() for k, v in normal.state_dict().items()}
    sizes = {n: p.numel() for n, p in normal.named_parameters()}
    inv_freq_built = normal.model.rotary_emb.inv_freq.clone()
    ref = reference_from(normal, batches)
    for losses, state, inv_freq, first, pieces in pools.run(2, _train_bunsan_zero_init, 2, _cfg(3), batches, tie):
        for k, v in built.items():
            torch.testing.assert_close(first[k], v, rtol=0, atol=0, msg=k)   # the same draws, bit for bit
        assert pieces.keys() == sizes.keys()
        assert all(pieces[n] <= (sizes[n] + 1) // 2 for n in sizes)           # each rank kept half
        torch.testing.assert_close(inv_freq, inv_freq_built, rtol=0, atol=0)
        check_runs([(losses, state, None)], *ref)


def test_hf_meta_build_refuses_what_it_cannot_replay():
    class WithExtra(transformers.LlamaForCausalLM):     # a parameter _init_weights never writes
        def __init__(self, config):
            super().__init__(config)
            self.extra = torch.nn.Parameter(torch.randn(4))
            self.post_init()

    config = tiny("llama").config
    with pytest.raises(ValueError, match="extra.*not written by the model's _init_weights"):
        with bunsan.zero.Init():
            WithExtra(config)


def _load_pretrained(rank, world, cfg, path):
    torch.manual_seed(99)                 # other weights than the directory's
    model = tiny("llama")
    for p in model.parameters():
        torch.nn.init.normal_(p.data)
    engine = bunsan.initialize(model, cfg)
    engine.load_hf_weights(path)
    return engine.consolidated_state_dict()


@pytest.mark.parametrize("layout", ["zero3", "tp2"])
def test_pretrained_weights_load_straight_into_shards(pools, tmp_path, layout):
    source = tiny("llama")
    source.save_pretrained(tmp_path)
    cfg = _cfg(3) if layout == "zero3" else _tp_cfg(2, 2)
    for state in pools.run(2, _load_pretrained, 2, cfg, str(tmp_path)):
        for k, v in source.state_dict().items():
            torch.testing.assert_close(state[k], v, rtol=0, atol=0, msg=k)


def test_hf_meta_build_follows_a_seed_set_inside_the_block():
    torch.manual_seed(7)      # tiny() seeds 0 inside the block: the normal build's values are seed 0's
    with bunsan.zero.Init():
        model = tiny("llama")
    after_build = torch.rand(3)
    normal = tiny("llama")
    assert torch.equal(after_build, torch.rand(3))                  # the generator stands where a normal build's does
    from bunsan.zero.slices import slice_of
    for n, p in model.named_parameters():
        torch.testing.assert_close(slice_of(p).piece.view(p.shape), dict(normal.named_parameters())[n],
                                   rtol=0, atol=0, msg=n)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "mistral_sliding", "gpt2"])
def test_hf_meta_build_equals_a_normal_build_for_each_architecture(arch):
    from bunsan.zero.slices import slice_of
    build = _gpt2 if arch == "gpt2" else (lambda: tiny(arch, tie_word_embeddings=True))
    normal = build()
    with bunsan.zero.Init():
        model = build()
    for n, p in model.named_parameters(remove_duplicate=False):
        torch.testing.assert_close(slice_of(p).piece.view(p.shape),
                                   dict(normal.named_parameters(remove_duplicate=False))[n], rtol=0, atol=0, msg=n)
    for n, b in model.named_buffers():
        torch.testing.assert_close(b, dict(normal.named_buffers())[n], rtol=0, atol=0, msg=n)


@pytest.mark.parametrize("arch,head_dim", [("llama", None), ("qwen3", 16)])
def test_the_mfu_of_an_init_from_model_counts_its_query_heads_width(tmp_path, arch, head_dim):
    """`bunsan train --init-from`'s meter counts 6N + 12·L·h·s FLOPs a token with h the query heads' width: the
    hidden size, or heads x head_dim where head_dim is set apart (16 x 4 = 64 on hidden 32 here)."""
    from bunsan.config import Config
    from bunsan.models import flops_per_token
    from bunsan.training.hf_model import load_hf_model
    tiny(arch, **({"head_dim": head_dim} if head_dim else {})).save_pretrained(tmp_path)
    model, shape = load_hf_model(tmp_path, Config.load({"data": {"seq_len": SEQ, "packing": False}}), VOCAB)
    width = 4 * (head_dim or 8)
    assert shape.attention_dim == width == model.model.layers[0].self_attn.q_proj.out_features
    n = sum(p.numel() for p in model.parameters()) - model.get_input_embeddings().weight.numel()
    assert flops_per_token(shape, SEQ) == 6 * n + 12 * 2 * width * SEQ
