"""A tiny byte-level BPE tokenizer with a ChatML chat template, as a Hugging Face tokenizer folder holds it
(tokenizer.json, tokenizer_config.json with the template): what fine-tuning tests feed `--format chat`."""

from __future__ import annotations

CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def save_chat_tokenizer(folder) -> None:
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    t = Tokenizer(models.BPE(vocab, []))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=t, eos_token="<|im_end|>",
                                                additional_special_tokens=["<|im_start|>"])
    fast.chat_template = CHATML
    fast.save_pretrained(folder)
