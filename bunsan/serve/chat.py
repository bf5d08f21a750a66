"""Chat messages to a prompt: the checkpoint's own chat template when it has one (a Hugging Face
`tokenizer_config.json` `chat_template`, or `chat_template.jinja`), rendered by transformers'
`apply_chat_template`; else `--chat-template FILE`; else DEFAULT_TEMPLATE (ChatML), rendered by the same
transformers renderer (its sandboxed Jinja environment). Messages with roles the template refuses (its own
`raise_exception`) are a 400.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from bunsan.checkpoint.untrusted import read_small
from bunsan.models.hf import has_chat_template
from bunsan.serve.errors import ApiError

log = logging.getLogger("bunsan.serve")

# ChatML: each message as <|im_start|>role\ncontent<|im_end|>\n, then the assistant's turn opened. A model
# without chat training ends its turn by writing <|im_end|> at best, so that is a stop string of this template.
DEFAULT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
DEFAULT_STOP = ["<|im_end|>"]


class ChatTemplate:
    """`render(messages)` -> the prompt's token ids, through `tokenizer` (the server's, which decodes too)."""

    def __init__(self, tokenizer, folder: Path | None = None, template: str | None = None):
        self.tokenizer, self.hf, self.template = tokenizer, None, template
        self.stop: list[str] = []
        self.eos_ids: set[int] = set()
        if template is None and folder is not None and has_chat_template(folder):
            from transformers import AutoTokenizer
            self.hf = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
            if self.hf.eos_token_id is not None:      # a chat model's end of turn is often not tokenizer.json's
                self.eos_ids.add(int(self.hf.eos_token_id))
        if folder is not None:
            self.eos_ids |= generation_eos_ids(Path(folder))
        elif template is None:
            self.template, self.stop = DEFAULT_TEMPLATE, list(DEFAULT_STOP)
        self.source = ("the checkpoint's chat template" if self.hf is not None else
                       "the default ChatML template" if self.template == DEFAULT_TEMPLATE else "--chat-template")

    def text(self, messages: list[dict]) -> str:
        from jinja2.exceptions import TemplateError
        try:
            if self.hf is not None:
                return self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            from transformers.utils.chat_template_utils import render_jinja_template
            rendered, _ = render_jinja_template(conversations=[messages], chat_template=self.template,
                                                add_generation_prompt=True, bos_token="", eos_token="")
            return rendered[0]
        except TemplateError as e:          # the template's raise_exception: e.g. roles out of order
            raise ApiError(400, f"the chat template refused these messages: {e}", param="messages") from e

    def render(self, messages: list[dict]) -> list[int]:
        ids = self.tokenizer.encode(self.text(messages))
        if not ids:
            raise ApiError(400, "the messages render to an empty prompt; send some content", param="messages")
        return ids


def generation_eos_ids(folder: Path) -> set[int]:
    """generation_config.json's eos_token_id (one id or a list: Llama 3's <|end_of_text|>, <|eot_id|>, ...), the
    ids the model ends a turn with; none when the file is missing. A file that is not such JSON is said, and
    ignored: the tokenizer's own end token still stops."""
    path = folder / "generation_config.json"
    if not path.exists():
        return set()
    text = read_small(path)
    try:
        data = json.loads(text) if text is not None else None
    except ValueError:
        data = None
    ids = data.get("eos_token_id") if isinstance(data, dict) else "unreadable"
    if ids is None:
        return set()
    ids = [ids] if isinstance(ids, int) and not isinstance(ids, bool) else ids
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        log.warning("%s: not a JSON object with eos_token_id as one id or a list of ids; stopping at the "
                    "tokenizer's end token only", path)
        return set()
    return set(ids)
