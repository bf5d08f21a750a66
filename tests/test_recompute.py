"""Selective recompute and activation offload (issue #24) against no recompute, and what they keep against the
estimator: bunsan's Llama and a Hugging Face Llama, fp32, SGD without clipping, rtol 1e-5; single process,
tensor (and sequence) parallel, pipeline. Bytes are measured with bunsan.memory.held (every storage a forward
leaves alive), which sees selective checkpointing's kept outputs where saved_tensors_hooks do not."""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import bunsan
from bunsan.config.root import Config, ConfigError
from bunsan.estimator import estimate_layout
from bunsan.estimator.activations import Micro, block_bytes, block_input_bytes, stage_activation_bytes
from bunsan.estimator.layout import Layout
from bunsan.estimator.recompute import kept_per_block, selective_kept, stage_bytes
from bunsan.memory.held import held_for_backward
from bunsan.models import Llama
from bunsan.models.llama import LlamaConfig
from bunsan.models.blocks import SELECTIVE_OPS
from bunsan.models.presets import build_config
from bunsan.planner.cost import step_time
from bunsan.planner.search import plan
from bunsan.transforms.checkpointing import apply_activation_checkpointing
from bunsan.transforms.offload import HostCopy, apply_activation_offload, stretch_of
from bunsan.transforms.selective import apply_selective_recompute
from parity import Setup, assert_parity, reference_for, sgd_no_clip, train

GiB = 1024 ** 3
SETUP = Setup(steps=3, rows=4, seq=32)
CHOICES = [{"mode": "full"}, {"mode": "selective"}, {"mode": "selective", "recompute": ["swiglu"]},
           {"mode": "selective", "recompute": []}, {"offload_blocks": 2},
           {"mode": "selective", "offload_blocks": "all"}, {"enabled": True, "cpu_checkpointing": True}]


def _cfg(ac: dict, **more) -> dict:
    return sgd_no_clip({"train_micro_batch_size_per_gpu": SETUP.rows, "activation_checkpointing": ac, **more})


def _ids(ac: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in ac.items())


# -- parity with no recompute -------------------------------------------------------------------------------
@pytest.mark.parametrize("ac", CHOICES, ids=_ids)
def test_bunsan_llama_matches_no_recompute(ac):
    cfg = _cfg(ac)
    assert_parity([train(0, 1, cfg, SETUP)], reference_for(cfg, SETUP))


def test_lora_selective_matches_no_recompute():
    """peft's layers: the base matmul's output is kept, the adapters' recomputed; o_proj is no plain Linear."""
    pytest.importorskip("peft")
    cfg = _cfg({"mode": "selective"}, lora={"enabled": True, "r": 4,
                                           "target_modules": ["q_proj", "v_proj", "o_proj", "up_proj"]})
    assert_parity([train(0, 1, cfg, SETUP)], reference_for(cfg, SETUP))


@pytest.mark.parametrize("ac", CHOICES[1:3] + CHOICES[5:6], ids=_ids)
def test_hugging_face_llama_matches_no_recompute(ac):
    from test_hf_models import data, reference, tiny
    batches = data()
    engine = bunsan.initialize(tiny("llama"), sgd_no_clip({"train_batch_size": 4, "activation_checkpointing": ac,
                                                           "steps_per_print": 100}, lr=0.5))
    losses = [engine.train_batch(b) for b in batches]
    ref_losses, ref_state = reference("llama", batches)
    state = engine.consolidated_state_dict()
    assert_parity([(losses, {k: state[k] for k in ref_state})], (ref_losses, ref_state))


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2_sp"])
@pytest.mark.parametrize("ops", [list(SELECTIVE_OPS), ["attention"]], ids=["both", "attention"])
def test_tensor_parallel_selective_matches_no_recompute(pools, sp, ops):
    """o_proj is a row layer that all-reduces in place: selective keeps the residual after it instead; the
    all-gathers into attention and MLP are recomputed, whatever else is kept."""
    cfg = _cfg({"mode": "selective", "recompute": ops, "offload_blocks": 1},
               tensor_parallel={"size": 2, "sequence_parallel": sp})
    assert_parity(pools.run(2, train, 2, cfg, SETUP), reference_for(cfg, SETUP))


def test_zero3_selective_and_offload_match_no_recompute(pools):
    """ZeRO-3 gathers a block's weights in its forward and again for its backward, where the recompute runs."""
    cfg = _cfg({"mode": "selective", "offload_blocks": 2}, train_micro_batch_size_per_gpu=2,
               zero_optimization={"stage": 3, "stage3_param_persistence_threshold": 0})
    assert_parity(pools.run(2, train, 2, cfg, SETUP), reference_for(cfg, SETUP))


def test_pipeline_selective_and_offload_match_no_recompute(pools):
    cfg = _cfg({"mode": "selective", "recompute": ["attention"], "offload_blocks": 1},
               pipeline={"stages": 2}, gradient_accumulation_steps=2, train_micro_batch_size_per_gpu=2)
    assert_parity(pools.run(2, train, 2, cfg, SETUP), reference_for(cfg, SETUP))


def _train_hf_tp(rank, world, cfg):
    from test_hf_models import data, tiny
    engine = bunsan.initialize(tiny("llama"), cfg)
    losses = [engine.train_batch(b) for b in data()]
    return losses, engine.consolidated_state_dict()


def test_hugging_face_llama_tensor_parallel_selective(pools):
    from test_hf_models import data, reference
    cfg = sgd_no_clip({"train_batch_size": 4, "steps_per_print": 100, "tensor_parallel": {"size": 2},
                       "activation_checkpointing": {"mode": "selective"}}, lr=0.5)
    ref_losses, ref_state = reference("llama", data())
    runs = [(losses, {k: state[k] for k in ref_state}) for losses, state in pools.run(2, _train_hf_tp, 2, cfg)]
    assert_parity(runs, (ref_losses, ref_state))


# -- what selective keeps and re-runs -------------------------------------------------------------------------
def _per_block(build, ids, transform) -> float:
    """Bytes one block leaves for backward: a 3-block model's less a 1-block model's, halved."""
    held = []
    for layers in (1, 3):
        model = transform(build(layers))
        logits, alive = held_for_backward(lambda: model(ids))
        held.append(alive.get("cpu", 0))
        logits.float().sum().backward()
    return (held[1] - held[0]) / 2


def _selective(ops):
    def apply(model):
        apply_selective_recompute(model, ops)
        return model
    return apply


def _full(model):
    apply_activation_checkpointing(model)
    return model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kv_heads", [2, 4], ids=["gqa", "mha"])
@pytest.mark.parametrize("ops", [SELECTIVE_OPS, ("swiglu",), ("attention",), ()], ids=lambda o: "+".join(o) or "-")
def test_selective_keeps_what_the_estimator_prices(dtype, kv_heads, ops):
    def build(layers):
        torch.manual_seed(0)
        return Llama(build_config("tiny", num_hidden_layers=layers, vocab_size=512,
                                  num_key_value_heads=kv_heads)).to(dtype)
    b, s = 3, 40
    ids = torch.randint(0, 512, (b, s))
    c, m = build(1).config, Micro(b, s, dtype.itemsize, device="cpu")
    assert _per_block(build, ids, _selective(ops)) == sum(selective_kept(c, m, ops).values())
    if ops == SELECTIVE_OPS:    # the same measure agrees with the saved-tensor count for none and full
        assert _per_block(build, ids, lambda model: model) == block_bytes(c, m)
        assert _per_block(build, ids, _full) == block_input_bytes(c, m)
        assert kept_per_block(c, m, "selective") < 0.75 * kept_per_block(c, m, "none")


@pytest.mark.parametrize("ops", [SELECTIVE_OPS, ()], ids=lambda o: "+".join(o) or "-")
def test_heads_set_apart_from_hidden_keep_what_the_estimator_prices(ops):
    """head_dim 48 on hidden 128 / 4 heads: the q projection and the attention core are 192 wide, not 128."""
    def build(layers):
        torch.manual_seed(0)
        return Llama(build_config("tiny", num_hidden_layers=layers, vocab_size=512, head_dim=48))
    b, s = 3, 40
    ids = torch.randint(0, 512, (b, s))
    c, m = build(1).config, Micro(b, s, 4, device="cpu")
    assert _per_block(build, ids, _selective(ops)) == sum(selective_kept(c, m, ops).values())
    assert _per_block(build, ids, lambda model: model) == block_bytes(c, m)


def _held_under_tp(rank, world, sp, ids):
    held = []
    for layers in (1, 3):
        torch.manual_seed(0)
        model = Llama(build_config("tiny", num_hidden_layers=layers, vocab_size=512))
        engine = bunsan.initialize(model, {"train_micro_batch_size_per_gpu": 1, "activation_checkpointing": {
            "mode": "selective"}, "tensor_parallel": {"size": 2, "sequence_parallel": sp}})
        logits, alive = held_for_backward(lambda: engine.module(ids))
        held.append(alive.get("cpu", 0))
        logits.float().sum().backward()
    return (held[1] - held[0]) / 2


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2_sp"])
def test_selective_under_tensor_parallel_keeps_what_the_estimator_prices(pools, sp):
    """q/k/v and gate/up outputs split over the ranks; the block input and the residual after attention
    whole, or each rank's slice of the sequence under SP."""
    b, s = 2, 32
    ids = torch.randint(0, 512, (b, s))
    c = build_config("tiny", vocab_size=512)
    want = sum(selective_kept(c, Micro(b, s, 4, tp=2, sp=sp, device="cpu")).values())
    assert pools.run(2, _held_under_tp, 2, sp, ids) == [want, want]


@pytest.mark.parametrize("arch,kv_heads,head_dim", [("llama", 2, None), ("llama", 4, None), ("llama", 2, 16),
                                                    ("qwen3", 2, None), ("qwen3", 2, 16)])
def test_hugging_face_block_keeps_the_same(arch, kv_heads, head_dim):
    """A transformers Llama's or Qwen3's block under selective recompute keeps what the estimator prices for
    bunsan's Llama block of its shape (Qwen3's q/k norms are recomputed from the kept q and k projections),
    heads set apart from hidden / heads (16, not 32 / 4) included."""
    transformers = pytest.importorskip("transformers")
    classes = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
               "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM)}[arch]

    def build(layers):
        torch.manual_seed(0)
        return classes[1](classes[0](
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
            num_key_value_heads=kv_heads, max_position_embeddings=64, head_dim=head_dim or 8))
    b, s = 2, 12
    ids = torch.randint(0, 64, (b, s))
    shape = build(1).config
    c = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                    num_key_value_heads=kv_heads, head_dim=shape.head_dim)

    def run(model):
        inner = model.forward
        model.forward = lambda x: inner(input_ids=x, use_cache=False).logits
        return model
    kept = _per_block(build, ids, lambda model: run(_selective(SELECTIVE_OPS)(model)))
    assert kept == sum(selective_kept(c, Micro(b, s, 4, device="cpu")).values())


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count[func.__name__.split(".")[0]] += 1
        return func(*args, **(kwargs or {}))


def _backward_ops(model, ids) -> Counter:
    out = model(ids)
    with _Ops() as ops:
        out.float().square().mean().backward()
    return ops.count


def test_selective_runs_no_matmul_again():
    """At tp 1 every matmul's output is kept (down_proj's never runs again: the recompute stops at its input);
    the attention core runs once more, unless it is left out."""
    torch.manual_seed(0)
    model = Llama(build_config("tiny", num_hidden_layers=2, vocab_size=512))
    ids = torch.randint(0, 512, (2, 24))
    plain = _backward_ops(copy.deepcopy(model), ids)
    core = "_scaled_dot_product_flash_attention_for_cpu"
    for ops, cores in ((SELECTIVE_OPS, 2), (("swiglu",), 0)):
        again = _backward_ops(_selective(ops)(copy.deepcopy(model)), ids)
        assert again["mm"] == plain["mm"] and again[core] == cores and plain[core] == 0


def test_selective_needs_a_llama_shaped_block():
    blocks = torch.nn.ModuleList([torch.nn.Linear(4, 4)])
    model = torch.nn.Module()
    model.layers = blocks
    with pytest.raises(ValueError, match="self_attn.q_proj.*mode full"):
        apply_selective_recompute(model)
    with pytest.raises(ValueError, match="'flash'.*choose from"):
        apply_selective_recompute(Llama(build_config("tiny", num_hidden_layers=1)), ("flash",))


# -- offload -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["none", "full", "selective"])
def test_offload_moves_what_the_estimator_prices(mode):
    torch.manual_seed(0)
    model = Llama(build_config("tiny", num_hidden_layers=3, vocab_size=512, num_key_value_heads=2))
    reference = copy.deepcopy(model)
    if mode == "full":
        apply_activation_checkpointing(model)
    elif mode == "selective":
        apply_selective_recompute(model)
    offloads = apply_activation_offload(model, 2, copy_cpu=True)   # the copy path, without a GPU
    ids = torch.randint(0, 512, (3, 40))
    model(ids).square().mean().backward()
    reference(ids).square().mean().backward()
    m = Micro(3, 40, 4, device="cpu")
    moved = block_bytes(model.config, m) if mode == "none" else block_input_bytes(model.config, m)
    assert [o.host_bytes for o in offloads] == [moved, moved]
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)


def test_a_host_copy_keeps_the_view():
    base = torch.arange(60.0).reshape(3, 4, 5)
    for view in (base.transpose(0, 2), base[1:, :, 2], base[:, 1]):
        copied = HostCopy(stretch_of(view), None)
        back = copied.to_device().view(view.dtype).as_strided(view.shape, view.stride())
        assert torch.equal(back, view) and back.stride() == view.stride()
        assert copied.host.numel() <= base.numel() * 4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: the asynchronous pinned copies")
def test_offload_on_the_gpu_matches():
    torch.manual_seed(0)
    model = Llama(build_config("tiny", num_hidden_layers=3, vocab_size=512)).cuda()
    reference = copy.deepcopy(model)
    offloads = apply_activation_offload(model, "all")
    ids = torch.randint(0, 512, (3, 40), device="cuda")
    model(ids).square().mean().backward()
    reference(ids).square().mean().backward()
    assert all(o.host_bytes == block_bytes(model.config, Micro(3, 40, 4)) for o in offloads)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)


# -- pricing: estimator, cost model, planner -------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["none", "full"])
@pytest.mark.parametrize("first,last", [(True, True), (False, False)])
def test_stage_bytes_are_the_estimators_for_none_and_full(mode, first, last):
    c, m = build_config("7b"), Micro(2, 4096, 2, tp=2, sp=True)
    want = stage_activation_bytes(c, m, 16, first, last, mode == "full", 3)
    got = stage_bytes(c, m, 16, first, last, mode, 3)
    assert {k: got[k] for k in want} == want and got["host"] == 0


def test_offloaded_blocks_move_to_host_memory():
    lay = Layout(seq_len=4096, micro_batch=2)
    c, m = build_config("7b"), Micro(2, 4096, 2)
    item = lambda e, name: next((i for i in e.items if i.name == name), None)   # noqa: E731
    plain, moved = estimate_layout("7b", lay), estimate_layout("7b", lay.replace(offload_blocks=10))
    assert item(plain, "offloaded activations") is None
    assert item(moved, "offloaded activations").host == 10 * block_bytes(c, m)
    assert item(plain, "activations").device - item(moved, "activations").device == 10 * block_bytes(c, m)
    selective = estimate_layout("7b", lay.replace(checkpointing="selective", offload_blocks="all"))
    assert item(selective, "offloaded activations").host == c.num_hidden_layers * block_input_bytes(c, m)
    on_cpu = estimate_layout("7b", lay.replace(offload_blocks=10), device_type="cpu")
    assert item(on_cpu, "offloaded activations") is None        # the host is the device: nothing moves
    assert moved.peak < plain.peak and selective.peak < plain.peak


def test_a_layout_says_its_recompute_in_its_config():
    for lay in (Layout(checkpointing="selective", recompute_ops=("attention",), offload_blocks=3),
                Layout(checkpointing=True, offload_blocks="all"), Layout(offload_blocks=2)):
        cfg = Config.load(lay.to_config({"activation_checkpointing": {"enabled": True, "cpu_checkpointing": True}}))
        assert Layout.from_config(cfg, 1) == lay
    assert Layout(checkpointing=True) == Layout(checkpointing="full") and Layout().checkpointing == "none"
    assert "sel(swiglu) act->cpu(2)" in Layout(checkpointing="selective", recompute_ops=("swiglu",),
                                               offload_blocks=2).describe()
    with pytest.raises(ValueError, match="Layout.checkpointing must be one of none, full, selective"):
        Layout(checkpointing="some")


def test_selective_recomputes_a_fraction_of_full():
    from bunsan.estimator.hardware import gpu_spec, interconnect
    c, link = build_config("7b"), interconnect("nvlink")

    def price(**kw):
        return step_time(c, Layout(seq_len=4096, **kw), gpu_spec("h100"), link, link, 8)
    full, sel = price(checkpointing="full"), price(checkpointing="selective")
    # selective reruns the attention core's forward (priced per GEMM, planner/compute.py), full the block's
    from bunsan.planner.compute import block_time
    from bunsan.planner.cost import EFFICIENCY
    blk = block_time(c, Layout(seq_len=4096), gpu_spec("h100"), EFFICIENCY)
    assert sel.recompute == pytest.approx(c.num_hidden_layers * blk.attention_forward)
    assert full.recompute == pytest.approx(c.num_hidden_layers * blk.forward)
    assert 0 < sel.recompute < full.recompute and price(checkpointing="selective", recompute_ops=()).recompute == 0
    tp = price(checkpointing="selective", recompute_ops=(), tp=2)     # o_proj's matmul, all-reduced in place
    assert tp.recompute > 0 and tp.tp_comm < price(checkpointing="full", tp=2).tp_comm
    assert price(offload_blocks=4).offload > price().offload == 0


def test_the_planner_offloads_the_blocks_that_do_not_fit():
    p = plan("1b", 1, 8 * GiB, gpu="h100", seq_len=8192, global_batch=8, precision="bf16", keep=3)
    best = p.ranked[0]
    assert best.layout.offload_blocks not in (0, "all")
    fewer = best.layout.replace(offload_blocks=best.layout.offload_blocks - 1)
    assert not best.risk and not p.rule.fits(estimate_layout("1b", fewer, gpu_memory=8 * GiB).peak, 8 * GiB)
    # where no recompute does not fit and selective does, selective without offload is first; with room for
    # every activation, nothing is recomputed
    roomy = plan("1b", 1, 20 * GiB, gpu="h100", seq_len=8192, global_batch=8, precision="bf16", keep=3)
    assert roomy.ranked[0].layout.checkpointing == "selective" and roomy.ranked[0].layout.offload_blocks == 0
    ample = plan("1b", 1, 24 * GiB, gpu="h100", seq_len=8192, global_batch=8, precision="bf16", keep=3)
    assert ample.ranked[0].layout.checkpointing == "none"


# -- the config -----------------------------------------------------------------------------------------------
def test_the_mode_follows_enabled_and_mode():
    ac = lambda d: Config.load({"activation_checkpointing": d}).activation_checkpointing   # noqa: E731
    assert (ac({}).recompute_mode, ac({"enabled": True}).recompute_mode) == ("none", "full")
    assert ac({"mode": "Selective"}).recompute_mode == "selective"
    assert ac({"mode": "selective", "recompute": ["attention"]}).recompute_ops == ("attention",)
    assert ac({"enabled": True, "cpu_checkpointing": True}).offloaded == "all"
    assert ac({"offload_blocks": "ALL"}).offloaded == "all" and ac({"offload_blocks": 3.0}).offloaded == 3
    again = Config.load({"activation_checkpointing": {"mode": "selective"}}).override(
        {"activation_checkpointing.enabled": True})
    assert again.activation_checkpointing.recompute_mode == "selective"


@pytest.mark.parametrize("section,words", [
    ({"enabled": True, "mode": "none"}, "mode: enabled is true"),
    ({"mode": "full", "recompute": ["swiglu"]}, "recompute: .*mode is full; set mode to selective"),
    ({"mode": "selective", "recompute": ["atention"]}, "did you mean 'attention'"),
    ({"mode": "selective", "recompute": ["swiglu", "swiglu"]}, "list each op once"),
    ({"offload_blocks": -1}, "offload_blocks: expected a count of blocks >= 0 or 'all', got -1"),
    ({"offload_blocks": "some"}, "got 'some'"),
    ({"enabled": True, "cpu_checkpointing": True, "offload_blocks": 2}, "offload_blocks 2 with cpu_checkpointing"),
])
def test_bad_recompute_config_is_a_clear_error(section, words):
    with pytest.raises(ConfigError, match=words):
        Config.load({"activation_checkpointing": section})


def test_compile_with_selective_or_offload_is_an_error():
    for section in ({"mode": "selective"}, {"offload_blocks": 1}):
        with pytest.raises(ConfigError, match="train.compile with activation_checkpointing.*compile to false"):
            Config.load({"activation_checkpointing": section, "train": {"compile": True}})
    Config.load({"activation_checkpointing": {"mode": "full"}, "train": {"compile": True}})


def test_cpu_checkpointing_without_recompute_is_refused_at_initialize():
    cfg = Config.load({"activation_checkpointing": {"cpu_checkpointing": True}})
    assert cfg.activation_checkpointing.offloaded == 0
    assert any("nothing is checkpointed" in line for line in cfg.unimplemented())
    with pytest.raises(ConfigError, match="cpu_checkpointing=true"):
        bunsan.initialize(Llama(build_config("tiny", num_hidden_layers=1)), cfg)

