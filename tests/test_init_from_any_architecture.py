"""`bunsan train --init-from DIR` for transformers causal LMs that are not Llamas (Qwen2, GPT-2): the run's first
loss is the loss transformers' own model computes on the same rows with the targets shifted once (a second
shift would train the model to predict two tokens ahead, silently); final/ is a Hugging Face directory of that
architecture, loaded by from_pretrained, generated from by `bunsan generate` (in one process and over two
tensor-parallel ranks), with the end tokens the model lists."""

from __future__ import annotations

import inspect
import json
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")

from chat_tokenizer import save_chat_tokenizer  # noqa: E402


def _config(kind: str):
    small = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=128)
    if kind == "qwen2":
        return transformers.Qwen2Config(**small, tie_word_embeddings=True)
    if kind == "qwen3":
        return transformers.Qwen3Config(**small, head_dim=16)
    if kind == "mistral":
        return transformers.MistralConfig(**small)
    if kind == "gemma2":
        return transformers.Gemma2Config(**small, head_dim=16, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if kind == "gemma3":
        return transformers.Gemma3TextConfig(**small, head_dim=16, sliding_window=16, pad_token_id=0, bos_token_id=1,
                                             eos_token_id=2)
    if kind == "phi3":
        return transformers.Phi3Config(**small, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if kind == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**small, head_dim=16, moe_intermediate_size=32, num_experts=4,
                                           num_experts_per_tok=2, norm_topk_prob=True)
    return transformers.GPT2Config(vocab_size=320, n_embd=64, n_layer=2, n_head=4, n_positions=128, bos_token_id=0,
                                   eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # (dropout: no parity)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    (d / "code.py").write_text("\n".join(inspect.getsource(m) for m in (json, inspect)))
    return d


@pytest.mark.parametrize("kind,layout", [("qwen2", ["--zero", "1"]), ("gpt2", ["--zero", "3"]),
                                         ("qwen3", ["--zero", "2"]), ("mistral", ["--tp", "2"]),
                                         ("gemma2", ["--zero", "0"]), ("gemma3", ["--zero", "1"]),
                                         ("phi3", ["--zero", "3"]), ("qwen3_moe", ["--ep", "2"])])
def test_train_from_a_transformers_directory_and_generate_from_the_result(pools, tmp_path, corpus, kind, layout):
    from bunsan.config.root import Config
    from bunsan.training.data import TokenBatches
    from bunsan.training.sources import load_source
    torch.manual_seed(0)
    source = tmp_path / kind
    start = transformers.AutoModelForCausalLM.from_config(_config(kind))
    start.save_pretrained(source)
    save_chat_tokenizer(source)
    eot = json.loads((source / "tokenizer.json").read_text())["added_tokens"][0]["id"]
    (source / "generation_config.json").write_text(json.dumps({"eos_token_id": [eot]}))
    out = tmp_path / "out"
    ranks = pools.cli(2, ["train", "--nproc", "2", "--init-from", source, "--steps", "2", "--micro-batch", "2",
                          "--seq-len", "32", *layout, "--lr", "0.01", "--data", corpus / "*.py", "--output", out,
                          "--set", f"data.cache_dir={tmp_path / 'cache'}", "--set", "data.val_fraction=0",
                          "--set", "steps_per_print=1", "--tokenizer", source / "tokenizer.json"], cwd=tmp_path)
    assert [r.returncode for r in ranks] == [0, 0], ranks
    final = out / "final"
    meta = json.loads((final / "bunsan.json").read_text())
    cfg = Config.load(meta["bunsan_config"])
    # the first global batch, rebuilt as the run built it, through transformers' own loss (one shift)
    _, tokens = load_source(cfg, 0)
    rows = TokenBatches(tokens, cfg.data.seq_len, 2 if "--tp" in layout else 4, 0, 1, seed=cfg.train.seed,
                        val_fraction=0).batch_at(0)
    ids = torch.cat([rows["input_ids"], rows["labels"][:, -1:]], dim=1)
    with torch.no_grad():
        want = start(input_ids=ids, labels=ids).loss.item()
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()
              if "loss" in json.loads(line)]
    assert losses[0] == pytest.approx(want, rel=1e-5)
    tuned = transformers.AutoModelForCausalLM.from_pretrained(final)        # its own architecture, trained
    assert type(tuned) is type(start)
    moved = [n for n, p in tuned.named_parameters() if not torch.equal(p, start.state_dict()[n])]
    assert moved
    generate = ["generate", "--checkpoint", out, "--prompt", "def ", "--max-new-tokens", "8"]
    gen = pools.cli(1, generate)[0]
    assert gen.returncode == 0 and gen.stdout.startswith("def "), gen.stderr[-2000:]
    split = pools.cli(2, generate + ["--tp", "2"])[0]
    if kind == "gpt2":          # Conv1D layers and no plan: refused by name, never split wrongly
        assert split.returncode != 0 and "ships no tensor-parallel plan" in split.stderr, split.stderr[-2000:]
    else:                       # the model's own plan, the same greedy text as one process
        assert split.returncode == 0 and split.stdout == gen.stdout, split.stderr[-2000:]
    assert json.loads((final / "generation_config.json").read_text())["eos_token_id"] == [eot]
    converted = pools.cli(1, ["convert", out, tmp_path / "converted", "--to", "hf"])[0]
    assert converted.returncode == 0, converted.stderr[-2000:]
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "converted")
    assert all(torch.equal(p, tuned.state_dict()[n]) for n, p in again.state_dict().items())
    shutil.rmtree(tmp_path / "cache", ignore_errors=True)
