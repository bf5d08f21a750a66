"""Fine-tuning to serving, per chat template family: `bunsan train --init-from DIR --format chat` on a tiny
model of the family's architecture (Qwen2 for ChatML, Llama, Mistral, Gemma 2) whose tokenizer carries the
family's template and end-of-turn tokens, then `bunsan serve --checkpoint
RUN` answers the OpenAI chat endpoint through that template and stops at the end of the turn (finish_reason
"stop"), including where the end of turn is only in generation_config.json's eos_token_id list (Llama 3,
Gemma: the tokenizer's own eos_token is the end of text)."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from serve_harness import Server, http_post  # noqa: E402
from serve_harness import one_torch_thread  # noqa: E402,F401  (autouse: torch on one thread here)

# Each family's turn format, written here (shortened to what a one-turn chat uses): specials, the tokenizer's
# eos_token, generation_config.json's eos tokens (None: no file), bos, the template.
FAMILIES = {
    "chatml": (["<|im_start|>", "<|im_end|>"], "<|im_end|>", None, None,
               "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
               "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"),
    "llama3": (["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
               "<|end_of_text|>", ["<|end_of_text|>", "<|eot_id|>"], "<|begin_of_text|>",
               "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
               "{{ m['content'] }}<|eot_id|>{% endfor %}"
               "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"),
    "mistral": (["<s>", "</s>", "[INST]", "[/INST]"], "</s>", None, "<s>",
                "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} "
                "[/INST]{% else %} {{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"),
    "gemma": (["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"], "<eos>", ["<eos>", "<end_of_turn>"], "<bos>",
              "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else "
              "m['role'] }}\n{{ m['content'] }}<end_of_turn>\n{% endfor %}"
              "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"),
}

# each family on the architecture that uses it: bunsan's own Llama, or transformers' model for the others
ARCHITECTURE = {"chatml": "qwen2", "llama3": "llama", "mistral": "mistral", "gemma": "gemma2"}


def _model_dir(folder, family):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from bunsan.models import Llama, LlamaConfig
    from bunsan.models.hf import save_llama
    specials, eos, generation, bos, template = FAMILIES[family]
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    t = Tokenizer(models.BPE(vocab, []))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=t, eos_token=eos, bos_token=bos,
                                                additional_special_tokens=[s for s in specials if s not in (eos, bos)])
    fast.chat_template = template
    fast.save_pretrained(folder)
    small = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    if ARCHITECTURE[family] == "llama":
        cfg = LlamaConfig(**small)
        save_llama(Llama(cfg).state_dict(), cfg, folder)
    else:
        ids = {"bos_token_id": fast.bos_token_id, "eos_token_id": fast.eos_token_id, "pad_token_id": fast.eos_token_id}
        config = transformers.AutoConfig.for_model(ARCHITECTURE[family], **small, **ids)
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    if generation:               # (after the model: save_pretrained writes the config's own generation_config.json)
        (folder / "generation_config.json").write_text(json.dumps(
            {"eos_token_id": [fast.convert_tokens_to_ids(s) for s in generation]}))


def _chat(url: str, content: str) -> dict:
    r = http_post(url + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": content}], "max_tokens": 16, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_fine_tune_then_serve_with_the_models_own_template_ending_at_end_of_turn(pools, tmp_path, family):
    base = tmp_path / "base"
    _model_dir(base, family)
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Q{i}"},
                                                     {"role": "assistant", "content": "Sure."}]}) + "\n"
                            for i in range(16)))
    run = tmp_path / "run"
    r = pools.cli(1, ["train", "--nproc", "1", "--init-from", base, "--data", data, "--format", "chat", "--steps",
                      "40", "--micro-batch", "4", "--seq-len", "32", "--lr", "3e-3", "--output", run,
                      "--set", "data.val_fraction=0", "--set", "scheduler.params.warmup_steps=0"], cwd=tmp_path)[0]
    assert r.returncode == 0, r.stdout + r.stderr
    # the run loaded by `bunsan serve`'s own code, served in this process (test_serve_processes launches it)
    server = Server.of_command("--checkpoint", run, "--slots", "1", "--context", "128")
    try:
        choice = _chat(server.url, "Q3")
        assert choice["finish_reason"] == "stop", choice           # ended at the end of turn, not at max_tokens
        assert choice["message"]["content"].strip() == "Sure."
    finally:
        server.close()
