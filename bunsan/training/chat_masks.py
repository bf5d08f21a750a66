"""Which tokens of a chat conversation the loss is taken on: the assistant turns, found in the chat template's own
rendering. One rule for text chat (a tokenizer's template, examples.py) and multimodal chat (a processor's,
media_chat.py).

An assistant turn is what the template adds between the conversation rendered up to that turn with the
generation prompt and rendered through it, so its end-of-turn token is trained exactly as the template writes
it; a token is trained when its characters lie inside such a span.
"""

from __future__ import annotations

from typing import Callable

from bunsan.training.chat_records import BadRecord

__all__ = ["template_text", "assistant_spans", "trained_by_offsets"]


def template_text(apply: Callable, tools: list | None, where: str, whose: str = "the tokenizer's") -> Callable:
    """text(messages, prompt=False): the conversation as `apply` (a tokenizer's or a processor's
    apply_chat_template) renders it, any failure a BadRecord naming the record and `whose` template it is."""
    def text(upto: list[dict], prompt: bool = False) -> str:
        if not upto:
            raise BadRecord(f"{where}: the conversation opens with the assistant, so its first turn has no "
                            "prompt to be trained against; start it with a system or user message")
        try:
            out = apply(upto, tools=tools, tokenize=False, add_generation_prompt=prompt)
        except Exception as e:      # noqa: BLE001  (jinja's TemplateError, or a template's own TypeError)
            raise BadRecord(f"{where}: {whose} chat template cannot render this conversation "
                            f"({type(e).__name__}: {str(e)[:200]})") from None
        return out[0] if isinstance(out, list) and len(out) == 1 else out
    return text


def assistant_spans(text: Callable, messages: list[dict], where: str,
                    respond_from: int = 0) -> tuple[str, list[tuple[int, int]]]:
    """(the whole conversation's text, the character spans of its assistant turns from message `respond_from`
    on: a preference pair scores its response, not the prompt's turns)."""
    full = text(messages)
    if any(m.get("tool_calls") for m in messages) and \
            text([{k: v for k, v in m.items() if k != "tool_calls"} for m in messages]) == full:
        raise BadRecord(f"{where}: the chat template does not render tool_calls, so the calls would train as an "
                        "empty assistant turn; use a template that writes them (Qwen 2.5, Llama 3.1, Mistral's) or "
                        "drop them from the data")
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant" or i < respond_from:
            continue
        before, through = text(messages[:i], prompt=True), text(messages[:i + 1])
        if not (full.startswith(before) and full.startswith(through)):
            raise BadRecord(f"{where}: the chat template renders a conversation's beginning differently from the "
                            "whole conversation, so the assistant's tokens cannot be found; use "
                            "data.train_on_prompt or another template")
        spans.append((len(before), len(through)))
    return full, spans


def trained_by_offsets(offsets, spans: list[tuple[int, int]], train_on_prompt: bool) -> list[bool]:
    """Per token (its character offsets in the text): whether it lies inside an assistant span."""
    return [bool(train_on_prompt or any(a <= s and e <= b and e > s for a, b in spans)) for s, e in offsets]
