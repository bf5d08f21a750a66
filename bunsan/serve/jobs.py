"""One accepted request as the batcher's sequences and what comes back from them, whatever the API.

A Job has a Choice per sequence (each prompt times best_of). The batcher's callbacks only put token ids on
the job's asyncio queue (call_soon_threadsafe, from its thread); decoding and stop strings run here, on the
event loop, so a request's text work never holds up the batcher's step. A stop string found cancels that
sequence, which the batcher ends before its next step; a client that goes away (`watch`) cancels them all.
"""

from __future__ import annotations

import asyncio
import time
import uuid

from starlette.requests import Request as HTTPRequest

from bunsan.serve.batcher import Request
from bunsan.serve.requests import INT64, Generation
from bunsan.serve.sampling import RowSampler, SamplingParams, Token
from bunsan.serve.text import TextStream


def nth_seed(seed: int | None, j: int) -> int | None:
    """The seed of a request's j-th sequence: seed + j, kept within int64 (torch's range)."""
    return None if seed is None else (seed + j + INT64) % (2 * INT64) - INT64


class Choice:
    """One sequence's text so far: its tokens up to a stop string, and why it ended."""

    def __init__(self, index: int, prompt: int, ids: list[int], tokenizer, stop: list[str]):
        self.index, self.prompt, self.ids = index, prompt, ids
        self.text = TextStream(tokenizer, stop)
        self.tokens: list[Token] = []          # generated, up to and with the one that completed a stop string
        self.unsent: list[Token] = []          # tokens whose text has not gone out in a delta yet
        self.prompt_tokens: list[Token] | None = None
        self.pieces: list[str] = []
        self.end: str | None = None            # the batcher's reason
        self.work: Request | None = None

    def add(self, token: Token) -> str:
        """The text this token makes sendable; a stop string cancels the sequence (later tokens are dropped)."""
        if self.text.stopped:
            return ""
        self.tokens.append(token)
        self.unsent.append(token)
        delta = self.text.add(token.id)
        if self.text.stopped:
            self.work.cancelled = True
        self.pieces.append(delta)
        return delta

    def finish(self, end: str) -> str:
        """The held-back text, as the sequence ends."""
        self.end = end
        rest = self.text.rest() if not end.startswith("error") else ""
        self.pieces.append(rest)
        return rest

    def taken(self) -> list[Token]:
        """The tokens since the last call (their text went out in the delta just sent)."""
        out, self.unsent = self.unsent, []
        return out

    @property
    def reason(self) -> str:
        """OpenAI's finish_reason: "stop" for a stop string or the end of sequence, else "length"."""
        return "stop" if self.text.stopped or self.end == "eos" else "length"

    @property
    def completion_tokens(self) -> int:
        return len(self.tokens) + (self.end == "eos")

    @property
    def output(self) -> str:
        return "".join(self.pieces)

    @property
    def cumulative_logprob(self) -> float:
        return sum(t.logprob or 0.0 for t in self.tokens)


class Job:
    """A request's sequences, their queue of events, its id and creation time."""

    def __init__(self, gen: Generation, tokenizer, vocab: int, eos: frozenset[int], prefix: str, on_release,
                 constraint=None, metrics=None, adapter: tuple[int, int] = (0, 0)):
        """`constraint()`: a fresh structured.Constraint for each sequence of a request with a grammar;
        `metrics`: the server's metrics.ServeMetrics, told of every token and end; `adapter`: the (slot,
        prefix-cache root) of the LoRA adapter every sequence runs with (lora.py)."""
        self.gen, self.on_release, self.counted, self.metrics = gen, on_release, True, metrics
        self.adapter: str | None = None          # the LoRA adapter's name, when the request names one
        self.accepted_at = time.monotonic()
        self.loop, self.queue = asyncio.get_running_loop(), asyncio.Queue()
        self.rid, self.created, self.started = f"{prefix}-{uuid.uuid4().hex[:24]}", int(time.time()), time.time()
        self.choices: list[Choice] = []
        for p, ids in enumerate(gen.prompts):
            for j in range(gen.best_of):
                c = Choice(len(self.choices), p, ids, tokenizer, gen.stop)
                params = SamplingParams(**{**gen.sampling.__dict__, "seed": nth_seed(gen.sampling.seed, j)})
                sampler = RowSampler(params, ids, vocab, constraint() if constraint else None)
                c.work = Request(ids=ids, max_tokens=gen.max_tokens[p], emit=self._callback(c, "token"),
                                 finish=self._callback(c, "end"), sampler=sampler, eos=eos,
                                 prompt_logprobs=gen.prompt_logprobs, on_prompt=self._callback(c, "prompt"),
                                 adapter=adapter[0], root=adapter[1],
                                 media=gen.media[p] if gen.media else None)
                self.choices.append(c)
        self.ended = 0

    def _callback(self, choice: Choice, kind: str):
        def put(value) -> None:       # on the batcher's thread: hand over only
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (choice, kind, value))
        return put

    def submit(self, batcher) -> None:
        for c in self.choices:
            batcher.submit(c.work)

    async def events(self):
        """(choice, "delta", text) per token, (choice, "prompt", tokens), (choice, "end", held-back text), until
        every sequence ended; ("gone", None) if the client left first."""
        while self.ended < len(self.choices):
            choice, kind, value = await self.queue.get()
            if kind == "gone":
                yield None, "gone", None
                return
            if kind == "token":
                if self.metrics is not None:
                    self.metrics.token(self, choice)
                delta = choice.add(value)
                if delta:
                    yield choice, "delta", delta
            elif kind == "prompt":
                choice.prompt_tokens = value
                yield choice, "prompt", None
            else:
                self.ended += 1
                rest = choice.finish(value)
                if self.metrics is not None:
                    self.metrics.ended(self, choice)
                yield choice, "end", rest

    def error(self) -> str | None:
        """The first sequence's failure, if any ended with one."""
        return next((c.end.removeprefix("error: ") for c in self.choices if c.end and c.end.startswith("error")),
                    None)

    async def watch(self, http: HTTPRequest) -> None:
        """Until the client disconnects (a non-streamed request: the body is read, so the next message is the
        disconnect), then cancel every sequence: the batcher frees their slots before its next step."""
        while (await http.receive())["type"] != "http.disconnect":
            pass
        self.close()
        self.queue.put_nowait((None, "gone", None))

    def release(self) -> None:
        """Leave the open count once, whichever comes first."""
        if self.counted:
            self.counted = False
            self.on_release(self)

    def close(self) -> None:
        for c in self.choices:
            c.work.cancelled = True
        self.release()

    def usage(self) -> dict:
        prompt = sum(len(ids) for ids in self.gen.prompts)
        completion = sum(c.completion_tokens for c in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def best(self) -> list[Choice]:
        """The choices to answer with: all of them, or the n most likely of each prompt's best_of."""
        if self.gen.best_of == self.gen.n:
            return self.choices
        out = []
        for p in range(len(self.gen.prompts)):
            mine = [c for c in self.choices if c.prompt == p]
            out += sorted(mine, key=lambda c: -c.cumulative_logprob)[:self.gen.n]
        return out
