"""Chat messages to a prompt: the checkpoint's own chat template when it has one (a Hugging Face
`tokenizer_config.json` `chat_template`, or `chat_template.jinja`), rendered by transformers'
`apply_chat_template`; else `--chat-template FILE`; else DEFAULT_TEMPLATE (ChatML), rendered by the same
transformers renderer (its sandboxed Jinja environment). Messages with roles the template refuses (its own
`raise_exception`) are a 400.
"""

from __future__ import annotations

import logging
from pathlib import Path

from bunsan.models.hf import generation_eos_ids, has_chat_template
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
        elif template is None:
            self.template, self.stop = DEFAULT_TEMPLATE, list(DEFAULT_STOP)
        if folder is not None:
            self.eos_ids |= generation_eos_ids(Path(folder))
        self.source = ("the checkpoint's chat template" if self.hf is not None else
                       "the default ChatML template" if self.template == DEFAULT_TEMPLATE else "--chat-template")

    def text(self, messages: list[dict], image: str | None = None) -> str:
        """The prompt's text. Messages with image parts (lists of {"type": "text"|"image"}) go as they are to
        the checkpoint's template (a vision model's renders them); the default template gets their text with
        `image` (the processor's image token) where each image is."""
        from jinja2.exceptions import TemplateError
        if self.template == DEFAULT_TEMPLATE:
            messages = [m | {"content": "".join(p.get("text", image or "") for p in m["content"])}
                        if isinstance(m["content"], list) else m for m in messages]
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


