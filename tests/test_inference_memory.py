"""Memory of generation (bunsan.estimator.inference) against the real KV cache, the live tensors of a real run,
the placement it drives, and the predicted-versus-measured lines of `bunsan generate --device-map`."""

import importlib
import re

import pytest
import torch

from bunsan.estimator.inference import inference_memory
from bunsan.inference import model_blocks
from bunsan.inference.load import cpu_needs, plan
from bunsan.models import Llama, LlamaConfig, generate
from live_bytes import LiveBytes

MB = 1024 ** 2
gen = importlib.import_module("bunsan.models.generate")     # the module; bunsan.models.generate is the function


def tiny(**kw):
    base = dict(vocab_size=512, hidden_size=128, intermediate_size=344, num_hidden_layers=3, num_attention_heads=8,
                num_key_value_heads=4, max_position_embeddings=1024)
    return LlamaConfig(**{**base, **kw})


@pytest.mark.parametrize("tied,head_dim", [(False, None), (True, None), (False, 32)])
def test_weights_match_the_blocks_load_places(tied, head_dim):
    cfg = tiny(tie_word_embeddings=tied, head_dim=head_dim)       # 32: heads set apart from hidden / heads = 16
    with torch.device("meta"):
        model = Llama(cfg)
    for dtype in (torch.float32, torch.bfloat16):
        est = inference_memory(cfg, dtype=dtype)
        assert {b.name: b.bytes for b in model_blocks(model, dtype)} == est.weights
        assert sum(est.weights.values()) == cfg.num_params() * dtype.itemsize     # a tied table counted once


def test_kv_cache_is_what_generate_allocates(monkeypatch):
    caches = []

    class Recorded(gen.KVCache):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            caches.append(self)

    monkeypatch.setattr(gen, "KVCache", Recorded)
    cfg = tiny()
    model = Llama(cfg).eval().to(torch.bfloat16)
    generate(model, torch.randint(0, 512, (3, 10)), 7)
    est = inference_memory(cfg, batch=3, max_seq=17, dtype=torch.bfloat16, prompt_len=10)
    (cache,) = caches
    for i in range(cfg.num_hidden_layers):
        held = cache.k[i].numel() * cache.k[i].element_size() + cache.v[i].numel() * cache.v[i].element_size()
        assert held == est.kv_cache[f"layers.{i}"] == 2 * 3 * 4 * 17 * 16 * 2


@pytest.mark.parametrize("kv,dtype,prompt,new,head_dim", [
    (4, torch.float32, 64, 8, None), (8, torch.float32, 200, 4, None), (2, torch.bfloat16, 8, 150, None),
    (4, torch.float32, 32, 4, None), (4, torch.float32, 200, 4, 48)])     # 48: query heads 384 wide on 128
def test_activations_match_the_live_tensors_of_a_run(kv, dtype, prompt, new, head_dim):
    vocab = 4096 if prompt == 32 else 512          # a large vocabulary: the prompt's logits are the peak
    cfg = tiny(num_key_value_heads=kv, vocab_size=vocab, head_dim=head_dim)
    model = Llama(cfg).eval().to(dtype)
    ids = torch.randint(0, vocab, (2, prompt))
    with torch.no_grad(), LiveBytes() as live:
        generate(model, ids, new)
    est = inference_memory(cfg, batch=2, max_seq=prompt + new, dtype=dtype, prompt_len=prompt)
    pred = est.device_bytes(est.weights)          # one device: its KV caches and its peak step, no weights
    assert 0.9 <= live.peak / (pred["kv_cache"] + pred["activations"]) <= 1.02


def test_a_longer_sequence_pushes_blocks_off_a_device():
    cfg = tiny()
    short = inference_memory(cfg, max_seq=64, prompt_len=16)
    front = ("embed_tokens", "layers.0", "layers.1")
    cap = short.step + sum(short.block_bytes(n) for n in front)            # exactly the front blocks, at 64 tokens
    budgets = {0: cap, 1: 100 * MB}
    m = plan(short, False, budgets, "sequential")
    assert [m[n] for n in short.weights] == [0, 0, 0, 1, 1, 1]
    long = inference_memory(cfg, max_seq=1024, prompt_len=16)              # longer KV caches
    assert long.kv_cache["layers.0"] > short.kv_cache["layers.0"]
    m = plan(long, False, budgets, "sequential")                         # and a longer last decode step
    assert [m[n] for n in long.weights] == [0, 1, 1, 1, 1, 1]
    # the bare weights would still fit: without KV caches and activations the old placement comes back
    bare = [n for n, d in plan(long, False, {0: sum(long.weights[n] for n in front), 1: 100 * MB},
                               "sequential", headroom={0: 0, 1: 0}).items() if d == 0]
    assert len(bare) == 2                    # layers.1's KV cache still counts; headroom only replaces activations


def test_the_cpu_keeps_room_for_what_disk_blocks_need():
    cfg = tiny()
    est = inference_memory(cfg, max_seq=256, prompt_len=16)
    budget = sum(est.weights.values()) * 3 // 4
    m = plan(est, False, {"cpu": budget}, "sequential")
    disk = [n for n, d in m.items() if d == "disk"]
    on_cpu = sum(est.block_bytes(n) for n, d in m.items() if d == "cpu")
    needs = sum(est.kv_cache.get(n, 0) for n in disk) + max(est.weights[n] for n in disk) + est.step
    assert disk and on_cpu and on_cpu + needs <= budget
    fewer = cpu_needs(est, {**m, disk[0]: "cpu"})                   # the first disk block would not have fit
    assert on_cpu + est.block_bytes(disk[0]) + est.step + sum(fewer.values()) > budget
    with pytest.raises(ValueError, match=r"max_memory\['cpu'\] 1 KiB is less than the .* the CPU needs"):
        plan(est, False, {"cpu": 1024}, "sequential")
    with pytest.raises(ValueError, match="max_seq 2000 must be in 1..max_position_embeddings 1024"):
        inference_memory(cfg, max_seq=2000)


def _ratio(line):
    return float(re.search(r"([0-9.]+)x predicted", line).group(1))


def test_generate_prints_predicted_and_measured_per_device(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    from bunsan.cli.main import main
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=512, intermediate_size=1376, num_hidden_layers=4,
                                   num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path, max_shard_size="20MB")   # 48 MB in fp32
    args = ["generate", "--checkpoint", str(tmp_path), "--prompt", "def f(x):", "--max-new-tokens", "16",
            "--device-map", "sequential"]
    assert main(args) == 0
    memory = capsys.readouterr().out.partition("memory per device")[2].splitlines()
    (cpu,) = [line for line in memory if line.startswith("cpu:")]
    assert "predicted" in cpu and "kv cache" in cpu and "activations" in cpu and "measured" in cpu
    assert 0.5 <= _ratio(cpu) <= 2.0                               # resident set growth is noisy: a loose bound
    assert main(args + ["--max-memory", "cpu=25MB"]) == 0
    memory = capsys.readouterr().out.partition("memory per device")[2].splitlines()
    (cpu,) = [line for line in memory if line.startswith("cpu:")]
    (disk,) = [line for line in memory if line.startswith("disk:")]
    assert "disk block read in" in cpu and "measured" in cpu
    assert "read per step, 16 steps" in disk and _ratio(disk) == 1.0    # the bytes the hooks read, exactly
