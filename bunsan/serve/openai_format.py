"""OpenAI's response shapes for completions and chat completions: whole bodies, stream chunks, and
log-probabilities (completions: tokens / token_logprobs / top_logprobs / text_offset; chat: content[] of
token, logprob, bytes, top_logprobs)."""

from __future__ import annotations

from bunsan.serve.jobs import Choice, Job
from bunsan.serve.sampling import Token


def token_text(tokenizer, token: int) -> tuple[str, list[int]]:
    """A token's text and its UTF-8 bytes. A byte token that is part of a character is written as OpenAI
    writes it, "bytes:\\xe6"."""
    text = tokenizer.decode([token])
    if getattr(tokenizer, "identity", None) == "byte":
        raw = [token]
        if text == "\ufffd":
            text = f"bytes:\\x{token:02x}"
        return text, raw
    return text, list(text.encode("utf-8"))


class CompletionFormat:
    """/v1/completions. `offsets` keeps each choice's text offset across stream chunks."""
    prefix, object, chunk_object = "cmpl", "text_completion", "text_completion"

    def __init__(self, job: Job, tokenizer, model: str):
        self.job, self.tokenizer, self.model = job, tokenizer, model
        self.offsets: dict[int, int] = {}

    def logprobs(self, choice: Choice, tokens: list[Token]) -> dict | None:
        if self.job.gen.logprobs is None:
            return None
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for t in tokens:
            text = token_text(self.tokenizer, t.id)[0]
            out["tokens"].append(text)
            out["token_logprobs"].append(t.logprob)
            out["top_logprobs"].append(None if t.top is None else
                                       {token_text(self.tokenizer, i)[0]: lp for i, lp in t.top})
            out["text_offset"].append(self.offsets.get(choice.index, 0))
            self.offsets[choice.index] = self.offsets.get(choice.index, 0) + len(self.tokenizer.decode([t.id]))
        return out

    def echo(self, choice: Choice) -> str:
        return self.tokenizer.decode(choice.ids) if self.job.gen.echo else ""

    def head(self, index: int, text: str, logprobs, reason: str | None) -> dict:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}

    def chunk(self, choices: list[dict], usage: dict | None = None) -> dict:
        body = {"id": self.job.rid, "object": self.chunk_object, "created": self.job.created, "model": self.model,
                "choices": choices}
        if usage is not None:
            body["usage"] = usage
        return body

    def prompt_part(self, choice: Choice, index: int) -> dict | None:
        """The echoed prompt, as a stream's first chunk of a choice (with its log-probabilities)."""
        if not self.job.gen.echo:
            return None
        tokens = choice.prompt_tokens or []
        return self.head(index, self.echo(choice), self.logprobs(choice, tokens) if tokens else None, None)

    def delta(self, choice: Choice, index: int, text: str, reason: str | None = None) -> dict:
        return self.head(index, text, self.logprobs(choice, choice.taken()), reason)

    def whole(self, choices: list[Choice]) -> dict:
        out = []
        for i, c in enumerate(choices):
            tokens = (c.prompt_tokens or []) + c.tokens
            out.append(self.head(i, self.echo(c) + c.output, self.logprobs(c, tokens), c.reason))
        return self.chunk(out, self.job.usage()) | {"object": self.object}


class ChatFormat(CompletionFormat):
    """/v1/chat/completions: a message per choice; a stream opens each choice with the assistant's role."""
    prefix, object, chunk_object = "chatcmpl", "chat.completion", "chat.completion.chunk"

    def logprobs(self, choice: Choice, tokens: list[Token]) -> dict | None:
        if self.job.gen.logprobs is None:
            return None
        content = []
        for t in tokens:
            text, raw = token_text(self.tokenizer, t.id)
            top = [dict(zip(("token", "bytes"), token_text(self.tokenizer, i)), logprob=lp) for i, lp in t.top or []]
            content.append({"token": text, "logprob": t.logprob, "bytes": raw, "top_logprobs": top})
        return {"content": content}

    def prompt_part(self, choice: Choice, index: int) -> dict | None:
        return {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None}

    def delta(self, choice: Choice, index: int, text: str, reason: str | None = None) -> dict:
        return {"index": index, "delta": {"content": text} if text or reason is None else {},
                "logprobs": self.logprobs(choice, choice.taken()), "finish_reason": reason}

    def whole(self, choices: list[Choice]) -> dict:
        out = [{"index": i, "message": {"role": "assistant", "content": c.output},
                "logprobs": self.logprobs(c, c.tokens), "finish_reason": c.reason} for i, c in enumerate(choices)]
        return self.chunk(out, self.job.usage()) | {"object": self.object}
