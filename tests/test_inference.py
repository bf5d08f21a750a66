"""A Hugging Face Llama spread over CPU and disk generates exactly what the whole model in memory does."""

import pytest
import torch

from bunsan.inference import load, model_blocks, summary
from bunsan.models import generate
from bunsan.models.hf import load_llama

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("tied", [False, True])
def test_cpu_and_disk_placement_generates_like_one_device(tmp_path, tied):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=172, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   tie_word_embeddings=tied)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path, max_shard_size="100KB")
    whole = load_llama(tmp_path).eval()
    ids = torch.randint(0, 256, (2, 12))
    want = generate(whole, ids, 24)
    blocks = model_blocks(whole, torch.float32)
    budget = sum(b.bytes for b in blocks) // 2
    model, dmap = load(tmp_path, "sequential", {"cpu": budget}, batch=2, max_seq=36, prompt_len=12)
    placed = summary(blocks, dmap)
    assert placed["cpu"] <= budget and placed["disk"] > 0
    assert dmap["embed_tokens"] == dmap["lm_head"] or not tied
    assert torch.equal(generate(model, ids, 24), want)                  # greedy, token for token
    on_disk = [n for n, w in dmap.items() if w == "disk"]
    for name in on_disk:                                                 # read for each use, dropped after
        assert all(p.is_meta for p in model.get_submodule(name).parameters())


def test_device_map_errors(tmp_path):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=172, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="leaves out"):
        load(tmp_path, {"embed_tokens": "cpu"})
    full = {"embed_tokens": "cpu", "layers.0": "cpu", "layers.1": "disk", "norm": "cpu", "lm_head": "disk"}
    with pytest.raises(ValueError, match="share one weight"):
        load(tmp_path, full)


def test_generate_command_with_a_device_map(tmp_path, capsys):
    from bunsan.cli.main import main
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=172, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    args = ["generate", "--checkpoint", str(tmp_path), "--prompt", "def ", "--max-new-tokens", "12"]
    assert main(args + ["--device-map", "sequential", "--max-memory", "cpu=300KB"]) == 0
    out = capsys.readouterr().out
    assert "cpu:" in out and "disk:" in out and "predicted" in out and "measured" in out
    text, _, memory = out.partition("memory per device")        # the text, then memory measured after it
    whole = generate(load_llama(tmp_path).eval(), torch.tensor([list(b"def ")]), 12)
    assert text.rstrip("\n") == bytes(whole[0].tolist()).decode("utf-8", errors="replace")
    assert "cpu:" in memory and "disk:" in memory
    assert main(args + ["--device-map", "auto", "--max-memory", "cpu300KB"]) == 2
    assert "not DEVICE=SIZE" in capsys.readouterr().err


def test_generate_command_with_a_device_map_in_bf16(tmp_path, capsys):
    """--dtype bf16 over CPU and disk: the same greedy text as the whole model loaded in bf16."""
    from bunsan.cli.main import main
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=172, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    args = ["generate", "--checkpoint", str(tmp_path), "--prompt", "def ", "--max-new-tokens", "12",
            "--device-map", "sequential", "--max-memory", "cpu=300KB", "--dtype", "bf16"]
    assert main(args) == 0
    text, _, memory = capsys.readouterr().out.partition("memory per device")
    whole = generate(load_llama(tmp_path, torch.bfloat16).eval(), torch.tensor([list(b"def ")]), 12)
    assert text.rstrip("\n") == bytes(whole[0].tolist()).decode("utf-8", errors="replace")
    assert "disk:" in memory


def test_without_budgets_everything_stays_on_the_cpu(tmp_path):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=172, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    _, dmap = load(tmp_path)
    assert set(dmap.values()) == {"cpu"}


@pytest.mark.parametrize("tied", [False, True])
def test_a_model_in_memory_is_placed_and_offloaded_to_a_directory(tmp_path, tied):
    """load(model, ..., offload_dir=): the blocks that fit stay in memory; the rest are written there and read
    per use. Greedy output equals the model's own."""
    from parity import tiny_model
    whole = tiny_model(0, tie_word_embeddings=tied).eval()
    ids = torch.randint(0, 256, (2, 12))
    want = generate(whole, ids, 16)
    budget = sum(b.bytes for b in model_blocks(whole, torch.float32)) // 2
    with pytest.raises(ValueError, match="pass offload_dir="):
        load(tiny_model(0, tie_word_embeddings=tied), "sequential", {"cpu": budget}, batch=2, max_seq=28,
             prompt_len=12)
    model, dmap = load(tiny_model(0, tie_word_embeddings=tied), "sequential", {"cpu": budget}, batch=2,
                       max_seq=28, prompt_len=12, offload_dir=tmp_path / "off")
    assert "disk" in dmap.values() and "cpu" in dmap.values()
    assert torch.equal(generate(model, ids, 16), want)
    in_memory, dmap = load(tiny_model(0, tie_word_embeddings=tied), "auto", batch=2, max_seq=28, prompt_len=12)
    assert set(dmap.values()) == {"cpu"}
    assert torch.equal(generate(in_memory, ids, 16), want)


def test_a_model_beyond_bytes_without_its_tokenizer_is_refused(tmp_path, capsys):
    from bunsan.cli.main import main
    cfg = transformers.LlamaConfig(vocab_size=4096, hidden_size=64, intermediate_size=172, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    assert main(["generate", "--checkpoint", str(tmp_path), "--prompt", "hi", "--device-map", "auto"]) == 2
    assert "vocabulary of 4096 tokens is not bytes (256): pass --tokenizer" in capsys.readouterr().err
