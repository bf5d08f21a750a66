"""The model's own end tokens: tokenizer_config.json's eos_token ends a trained example, and generation stops at
generation_config.json's eos_token_id (one id or a list), not at the first end-of-text token tokenizer.json
happens to hold (a Llama 3 Instruct model ends its turn with <|eot_id|>, not <|end_of_text|>)."""

from __future__ import annotations

import json

import pytest
import torch

from bunsan.training.tokenizer import load_tokenizer

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def llama3_style(tmp_path_factory):
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    folder = tmp_path_factory.mktemp("tok")
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    t = Tokenizer(models.BPE(vocab, []))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<|begin_of_text|>",
                                                eos_token="<|eot_id|>",
                                                additional_special_tokens=["<|end_of_text|>"])
    fast.save_pretrained(folder)
    ids = {name: fast.convert_tokens_to_ids(name) for name in ("<|end_of_text|>", "<|eot_id|>")}
    (folder / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [ids["<|end_of_text|>"], ids["<|eot_id|>"]]}))
    return folder, ids


def test_the_end_token_is_the_models_and_generation_stops_at_every_listed_one(llama3_style):
    folder, ids = llama3_style
    tok = load_tokenizer(folder)
    assert tok.eos_token_id == ids["<|eot_id|>"]                  # tokenizer_config.json's, not the first found
    assert tok.separator_ids() == [ids["<|end_of_text|>"]]        # between documents: the end of text, as before
    assert tok.stop_ids == [ids["<|eot_id|>"], ids["<|end_of_text|>"]]


def test_a_prompt_completion_example_ends_with_the_models_end_token(llama3_style):
    from bunsan.training.examples import Renderer
    folder, ids = llama3_style
    tok = load_tokenizer(folder)
    got, trained = Renderer("prompt_completion", tok, None, {}, False).render(
        {"prompt": "2+2=", "completion": "4"}, "x")
    assert got[-1] == ids["<|eot_id|>"] and trained[-1]


def test_generate_stops_at_any_of_the_end_tokens():
    from bunsan.models import generate
    from parity import tiny_model
    model = tiny_model(0).eval()
    prompt = torch.tensor([[5, 9, 3]])
    free = generate(model, prompt, 6)[0, 3:].tolist()
    stop = free[2]
    first = free.index(stop)                                       # where it first appears
    other = next(i for i in range(model.config.vocab_size) if i not in free)
    out = generate(model, prompt, 6, eos_token_id=[other, stop])[0, 3:].tolist()
    assert out == free[:first + 1]                                 # ends at it, as with a single id
    assert generate(model, prompt, 6, eos_token_id=stop)[0, 3:].tolist() == out
