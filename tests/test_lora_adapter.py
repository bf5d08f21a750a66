"""`lora.save`: the LoRA adapters as peft saves them (RUN/adapter), loaded by peft onto their base model, equal
to the merged model (RUN/final); generate takes the adapter folder (merged into its base) as the merged one."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from chat_tokenizer import save_chat_tokenizer  # noqa: E402

CHATS = [{"messages": [{"role": "user", "content": f"Add {i} and 1"}, {"role": "assistant", "content": f"{i + 1}."}]}
         for i in range(8)]


def _train(pools, tmp_path, base, save):
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in CHATS))
    out = tmp_path / f"out-{save}"
    return out, pools.cli(1, ["train", "--nproc", "1", "--init-from", base, "--lora", "--data", data, "--format",
                              "chat", "--steps", "3", "--seq-len", "48", "--micro-batch", "2", "--lr", "0.05",
                              "--output", out, "--set", "data.val_fraction=0", "--set", f"lora.save={save}"],
                          cwd=tmp_path)[0]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    from bunsan.models import Llama, LlamaConfig
    from bunsan.models.hf import save_llama
    d = tmp_path_factory.mktemp("base")
    cfg = LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    save_llama(Llama(cfg).state_dict(), cfg, d)
    save_chat_tokenizer(d)
    return d


def _generate(pools, path):
    r = pools.cli(1, ["generate", "--checkpoint", path, "--prompt", "Add", "--max-new-tokens", "8"])[0]
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


def test_the_adapter_on_its_base_is_the_merged_model(pools, tmp_path, base):
    out, r = _train(pools, tmp_path, base, "both")
    assert r.returncode == 0, r.stdout + r.stderr
    adapter = out / "adapter"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["base_model_name_or_path"] == str(base.resolve())
    assert (adapter / "tokenizer.json").is_file() and (adapter / "tokenizer_config.json").is_file()
    tuned = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(base), adapter).eval()
    merged = transformers.AutoModelForCausalLM.from_pretrained(out / "final").eval()
    plain = transformers.AutoModelForCausalLM.from_pretrained(base).eval()
    ids = torch.randint(0, 320, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got, want, before = tuned(ids).logits, merged(ids).logits, plain(ids).logits
    assert not torch.allclose(want, before, atol=1e-4)               # training moved the adapters
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert _generate(pools, adapter) == _generate(pools, out / "final")


def test_adapter_only_leaves_no_merged_copy_and_generate_takes_the_run(pools, tmp_path, base):
    out, r = _train(pools, tmp_path, base, "adapter")
    assert r.returncode == 0, r.stdout + r.stderr
    assert not (out / "final").exists() and (out / "adapter" / "adapter_model.safetensors").is_file()
    assert _generate(pools, out).startswith("Add")
    shutil.rmtree(out)


def test_an_adapter_needs_a_base_on_disk():
    from bunsan.config.root import Config
    with pytest.raises(ValueError, match="lora.save 'adapter' without train.init_from"):
        Config.load({"lora": {"enabled": True, "save": "adapter"}})
