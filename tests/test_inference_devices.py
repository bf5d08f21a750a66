"""Inference across devices, checked on the CPU: inputs cross a device boundary once per forward (not once per
layer), tokens are drawn where the seeded generator lives, and --dtype reaches the weights and the KV cache.

A CPU has one device; `torch.device("cpu", i)` stands in for GPU i: moving a tensor there is a real copy (a
new tensor), so counting copies counts what a GPU would pay in host-to-device transfers."""

from __future__ import annotations

import gc
import importlib

import pytest
import torch

from bunsan.inference import load, placed
from bunsan.models import generate
from parity import tiny_model


def _fake_gpus(monkeypatch):
    """Device indices of a device map become cpu:i: each a device of its own to the hooks."""
    load_module = importlib.import_module("bunsan.inference.load")   # the package's `load` is the function
    monkeypatch.setattr(load_module, "_device",
                        lambda where: torch.device("cpu") if where in ("cpu", "disk") else torch.device("cpu", where))


def _counting_copies(monkeypatch) -> list[torch.Tensor]:
    """Every Tensor.to that returns a new tensor of the same dtype (a device copy) is recorded."""
    copies, real = [], torch.Tensor.to

    def to(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        if out is not self and out.dtype == self.dtype:
            copies.append(self)
        return out
    monkeypatch.setattr(torch.Tensor, "to", to)
    return copies


TWO_GPUS = {"embed_tokens": "cpu", "layers.0": 0, "layers.1": 0, "layers.2": 1, "layers.3": 1, "norm": 1,
            "lm_head": 1}


def test_a_device_boundary_costs_one_copy_of_the_rotary_tables(monkeypatch):
    """Four layers on two devices: the rotary tables are moved once to each device per forward, not once per
    layer; the placed model still generates what the whole one does."""
    whole = tiny_model(0).eval()
    ids = torch.randint(0, 256, (2, 7))
    want = generate(whole, ids, 6)
    _fake_gpus(monkeypatch)
    model, _ = load(tiny_model(0), dict(TWO_GPUS))
    assert torch.equal(generate(model, ids, 6), want)
    copies = _counting_copies(monkeypatch)
    with torch.no_grad():
        model(ids)
    head_dim = model.config.head_dim
    rope = [t for t in copies if t.is_floating_point() and t.dim() == 2 and t.shape[-1] == head_dim]
    assert len(rope) == 2 * 2, f"{len(rope)} copies of cos/sin for 2 devices (one of each table per device)"
    copies.clear()
    with torch.inference_mode():                    # a new forward, its own tensors (with no version counter)
        model(ids)
    assert len([t for t in copies if t.is_floating_point() and t.dim() == 2]) == 4
    assert not placed(model).input_moves.moved                         # nothing held past the forward


def test_serving_a_placed_model_equals_serving_the_whole_one(monkeypatch):
    """Rows at their own positions (the serving cache) through four layers on two devices: the same logits."""
    from bunsan.serve import PagedCache
    whole = tiny_model(0).eval()
    _fake_gpus(monkeypatch)
    placed, _ = load(tiny_model(0), dict(TWO_GPUS))
    prompts = [torch.randint(0, 256, (1, 5)), torch.randint(0, 256, (1, 3))]
    tables = torch.tensor([[1, 2], [3, 4]])                 # blocks of 4 tokens: rows 0 and 1
    outs = []
    with torch.no_grad():
        for model in (whole, placed):
            cache = PagedCache(model, 5, 4)
            for row, ids in enumerate(prompts):
                n = ids.shape[1]
                model(ids, kv_cache=cache.view(tables[row:row + 1], torch.tensor([0]), torch.tensor([n])))
            outs.append(model(torch.tensor([[7, 9]]), kv_cache=cache.view(tables, torch.tensor([5, 3]),
                                                                          torch.tensor([1, 1]))))
    assert torch.allclose(outs[0], outs[1], atol=1e-5)


def test_the_memo_of_moved_inputs_forgets_changed_and_dead_tensors():
    InputMoves = importlib.import_module("bunsan.inference.load").InputMoves
    moves, there = InputMoves(), torch.device("cpu", 1)
    t = torch.ones(3)
    first = moves.to(t, there)
    assert first is not t and moves.to(t, there) is first            # the same tensor, the same device: once
    assert moves.to(t, torch.device("cpu", 2)) is not first          # another device: its own copy
    t.add_(1)                                                        # changed in place: moved again
    again = moves.to(t, there)
    assert again is not first and torch.equal(again, t)
    assert moves.to(t, torch.device("cpu")) is t                     # already there: no copy
    del t, first, again
    gc.collect()
    assert not moves.moved                                           # a dead source takes its copies along
    moves.to(torch.ones(2), there)
    moves.clear()
    assert not moves.moved


def test_the_serving_cache_moves_rows_and_positions_once_per_device(monkeypatch):
    """A forward's block tables and token places reach each device once, however many of its layers sit there."""
    from bunsan.serve import PagedCache
    model = tiny_model(0).eval()
    cache = PagedCache(model, 6, 4)
    meta = torch.device("meta")                   # stands in for a GPU holding every layer's cache
    cache.k = [torch.empty(k.shape, device=meta) for k in cache.k]
    cache.v = [torch.empty(v.shape, device=meta) for v in cache.v]
    view = cache.view(torch.tensor([[1, 0], [2, 3]]), torch.tensor([3, 5]), torch.tensor([1, 1]))
    copies = _counting_copies(monkeypatch)
    cfg = model.config
    kv = torch.empty(1, cfg.num_key_value_heads, 2, cfg.head_dim, device=meta)
    q = torch.empty(1, cfg.num_attention_heads, 2, cfg.head_dim, device=meta)
    for i in range(cfg.num_hidden_layers):
        assert view.layer(i).attend(q, kv, kv).shape == q.shape
    longs = [t for t in copies if t.dtype == torch.long]
    # the token places, the decoding rows' tokens and their block tables
    assert len(longs) == 3, f"the forward's indices moved {len(longs)} times for 4 layers on one device"
    assert len([t for t in copies if t.dtype == torch.bool]) == 1    # and the attention mask once


def test_tokens_are_drawn_where_the_generator_lives():
    from bunsan.models.generate import next_token, sampling_device
    cpu_gen, gpu = torch.Generator(), torch.device("cuda", 0)
    assert sampling_device(gpu, cpu_gen) == torch.device("cpu")      # a CPU generator: sample on the CPU
    assert sampling_device(gpu, None) == gpu                         # no generator: where the logits are
    logits = torch.randn(4, 256, generator=torch.Generator().manual_seed(1))
    draw = [next_token(logits, 1.0, 20, torch.Generator().manual_seed(7), top_p=0.9) for _ in range(2)]
    assert torch.equal(draw[0], draw[1])
    # the same logits in a 16-bit model's dtype: sampling upcasts, so the same seed draws the same tokens
    exact = logits.to(torch.bfloat16)
    assert torch.equal(next_token(exact, 1.0, 20, torch.Generator().manual_seed(7)),
                       next_token(exact.float(), 1.0, 20, torch.Generator().manual_seed(7)))


@pytest.mark.parametrize("where", ["cpu", "disk"])
def test_a_bf16_load_has_bf16_weights_and_kv_cache(tmp_path, monkeypatch, where):
    """dtype reaches every block, those on disk included (read per use in that dtype), and the KV cache."""
    dmap = {"embed_tokens": where, "layers.0": "cpu", "layers.1": where, "layers.2": "cpu", "layers.3": "cpu",
            "norm": "cpu", "lm_head": "cpu"}
    model, _ = load(tiny_model(0), dmap, dtype=torch.bfloat16, offload_dir=tmp_path / "off")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.rope_cos.dtype == torch.float32            # positions stay exact; apply_rope casts per use
    captured = _record_kv_caches(monkeypatch)
    out = generate(model, torch.tensor([list(b"def ")]), 5)
    assert out.shape == (1, 9)
    assert {k.dtype for k in captured[0].k + captured[0].v} == {torch.bfloat16}


def _record_kv_caches(monkeypatch) -> list:
    """Every KVCache made from now on, in order (to read its dtype)."""
    from bunsan.models.generate import KVCache
    made, real = [], KVCache.__init__

    def spy(self, *args, **kwargs):
        real(self, *args, **kwargs)
        made.append(self)
    monkeypatch.setattr(KVCache, "__init__", spy)
    return made


def _trained_checkpoint(directory, model):
    """What `bunsan train` writes in final/: model.safetensors and config.json (the model's and bunsan's)."""
    import json

    from safetensors.torch import save_file

    from bunsan.config.root import Config
    directory.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps({"model": model.config.to_hf(),
                                                       "bunsan_config": Config.load({}).to_dict()}))
    return directory


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_dtype_is_one_of_three(tmp_path, capsys, command):
    from bunsan.cli.main import main
    with pytest.raises(SystemExit) as e:
        main([command, "--checkpoint", str(tmp_path), "--dtype", "fp64"])
    assert e.value.code == 2 and "invalid choice: 'fp64'" in capsys.readouterr().err


def test_generate_dtype_bf16_from_a_trained_checkpoint(tmp_path, capsys, monkeypatch):
    """--dtype bf16 loads the weights in bf16 (not fp32), the KV cache follows, greedy text comes out
    equal to the bf16 model's own generation."""
    from bunsan.cli.main import main
    from bunsan.cli.generate import trained_model
    whole = tiny_model(0).eval()
    ckpt = _trained_checkpoint(tmp_path / "final", whole)
    model, _ = trained_model(ckpt, dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    want = generate(model, torch.tensor([list(b"def ")]), 10)
    caches = _record_kv_caches(monkeypatch)
    assert main(["generate", "--checkpoint", str(tmp_path), "--prompt", "def ", "--max-new-tokens", "10",
                 "--dtype", "bf16"]) == 0
    assert capsys.readouterr().out.rstrip("\n") == bytes(want[0].tolist()).decode("utf-8", errors="replace")
    assert caches and caches[-1].k[0].dtype == torch.bfloat16


def test_serve_dtype_reaches_weights_and_the_kv_cache(tmp_path):
    """--dtype for each way `bunsan serve` loads: a trained checkpoint, a HF directory, a HF directory over a
    device map."""
    from bunsan.cli.main import build_parser
    from bunsan.cli.serve import load_model
    from bunsan.models.hf import save_llama
    from bunsan.serve import PagedCache
    whole = tiny_model(0).eval()
    _trained_checkpoint(tmp_path / "trained" / "final", whole)
    save_llama(whole.state_dict(), whole.config, tmp_path / "hf")
    for ckpt, extra in [("trained", []), ("hf", []), ("hf", ["--device-map", "sequential"])]:
        args = build_parser().parse_args(["serve", "--checkpoint", str(tmp_path / ckpt), "--dtype", "fp16",
                                          "--context", "64", *extra])
        model, _, _, context = load_model(args)
        assert {p.dtype for p in model.parameters()} == {torch.float16}, (ckpt, extra)
        cache = PagedCache(model, 2, 16)
        assert {k.dtype for k in cache.k + cache.v} == {torch.float16}, (ckpt, extra)


def test_tensor_parallel_generate_in_bf16(pools, tmp_path):
    """`generate --tp 2 --dtype bf16`: two processes, each its model on init_distributed's device (the CPU
    here), bf16 shards and KV cache; it runs and continues the prompt."""
    _trained_checkpoint(tmp_path / "final", tiny_model(0).eval())
    r = pools.cli(2, ["generate", "--checkpoint", tmp_path, "--prompt", "def ", "--max-new-tokens", "8", "--tp", "2",
                      "--dtype", "bf16"], cwd=tmp_path)[0]
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith("def ") and len(r.stdout.rstrip("\n")) > 4


def test_the_report_predicts_the_rotary_tables_beside_the_embedding():
    from bunsan.estimator.inference import inference_memory
    from bunsan.inference.report import predicted
    est = inference_memory(tiny_model(0).config, max_seq=64, prompt_len=8)
    on_gpu = predicted(est, dict(TWO_GPUS, embed_tokens=0), False)
    assert on_gpu[0]["rotary tables"] == est.rope and "rotary tables" not in on_gpu[1]
    assert on_gpu[0]["total"] == sum(v for k, v in on_gpu[0].items() if k != "total")
    on_disk = predicted(est, dict(TWO_GPUS, embed_tokens="disk"), False)
    assert on_disk["cpu"]["rotary tables"] == est.rope and "rotary tables" not in on_disk[0]


def test_measuring_a_gpu_initialises_cuda_before_resetting_its_peak(monkeypatch):
    """CUDA's caching allocator has no statistics before CUDA's first use: reset_peak_memory_stats then fails
    ("Invalid device argument"), which is how `generate --device-map auto` failed on the first lent H100."""
    from bunsan.inference import report
    from bunsan.memory import measure
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "init", lambda: calls.append("init"))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats",
                        lambda d=None: calls.append(("reset", d)) if "init" in calls else
                        (_ for _ in ()).throw(RuntimeError("Invalid device argument")))
    report.start({0: 1 << 30, "cpu": 1 << 30})
    measure.reset_peak_memory(torch.device("cuda", 0))
    assert calls[0] == "init" and ("reset", 0) in calls and ("reset", torch.device("cuda", 0)) in calls


@pytest.mark.e2e
def test_tensor_parallel_generate_launches_its_own_ranks(tmp_path):
    """The launch itself, once: `bunsan generate --tp 2` from a shell starts its two ranks (launch.relaunch) and
    prints what the pool's ranks print for the same command."""
    import os
    import subprocess
    import sys
    _trained_checkpoint(tmp_path / "final", tiny_model(0).eval())
    argv = ["generate", "--checkpoint", str(tmp_path), "--prompt", "def ", "--max-new-tokens", "8", "--tp", "2"]
    proc = subprocess.run([sys.executable, "-m", "bunsan.cli", *argv], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert proc.stdout.startswith("def ") and len(proc.stdout.rstrip("\n")) > 4


def test_generate_refuses_an_empty_prompt(tmp_path, capsys):
    from bunsan.cli.main import main
    _trained_checkpoint(tmp_path / "final", tiny_model(0).eval())
    with pytest.raises(SystemExit, match="--prompt is empty; give some text to continue"):
        main(["generate", "--checkpoint", str(tmp_path), "--prompt", ""])
