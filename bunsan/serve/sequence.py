"""What the batcher runs: a Request (one sequence a client asked for, and how it reports back) and, once
admitted, its Sequence (its place in the paged KV cache)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from bunsan.serve.media import Media
from bunsan.serve.sampling import RowSampler, SamplingParams, Token


@dataclass(eq=False)         # one of them is itself only (the batcher's queues are searched by identity)
class Request:
    """One sequence. `emit(Token)` is called for every new token, `finish(reason)` once at the end ("eos",
    "length", "cancelled" or "error: ..."), `on_prompt(tokens)` with the prompt's log-probabilities when
    `prompt_logprobs` asks for them; all from the batcher's thread."""
    ids: list[int]
    max_tokens: int
    emit: callable
    finish: callable
    sampler: RowSampler | None = None          # None: greedy
    eos: frozenset[int] = frozenset()
    prompt_logprobs: int | None = None
    on_prompt: callable = None
    cancelled: bool = False
    generated: int = 0
    last: int = 0
    adapter: int = 0                           # its LoRA adapter's slot (lora.py); 0: the base model
    root: int = 0                              # where its prefix-cache chain starts (each adapter its own)
    media: "Media | None" = None               # the prompt's images (media.py), shared by a prompt's sequences
    seq: "Sequence | None" = None              # the batcher's: its place in the cache

    def draw(self, logits: torch.Tensor) -> Token:
        if self.sampler is None:
            self.sampler = RowSampler(SamplingParams(), self.ids, logits.shape[-1])
        return self.sampler.draw(logits)


@dataclass(eq=False)
class Sequence:
    """A request's place in the cache: `tokens` to hold (the prompt, then each token fed back), the first
    `cached` of them written into `blocks`; the first `registered` blocks are in the prefix cache, the last
    of them under content id `parent`."""
    request: Request
    tokens: list[int]
    admitted: int                               # admission order: the latest is preempted first
    blocks: list[int] = field(default_factory=list)
    cached: int = 0
    registered: int = 0
    parent: int = 0
    resumed: bool = False                       # prefilled again after a preemption: no prompt logprobs
    prompt_logits: list = field(default_factory=list)

    def keys(self, start: int = 0, end: int | None = None) -> list:
        """Its tokens start..end as the prefix cache keys them: an image's tokens by the image (media.py)."""
        media = self.request.media
        if media is None:
            return self.tokens[start:end]
        end = len(self.tokens) if end is None else end
        return media.keys[start:min(end, media.length)] + self.tokens[max(start, media.length):end]

def check_fits(prompt: int, max_tokens: int, max_len: int, block_size: int, usable: int) -> None:
    """A request the batcher could never run is refused when submitted (a 400 at the server)."""
    if prompt + max_tokens > max_len:
        raise ValueError(f"prompt of {prompt} tokens + max_tokens {max_tokens} exceeds the context of {max_len} "
                         "tokens; shorten the prompt or ask for fewer tokens")
    need = -(-(prompt + max_tokens) // block_size)
    if need > usable:
        raise ValueError(f"prompt of {prompt} tokens + max_tokens {max_tokens} needs {need} KV blocks of {block_size} "
                         f"tokens; the cache holds {usable}: ask for fewer tokens")


def check_embeddable(tokens: int, max_len: int, tensor_parallel: bool) -> None:
    if tensor_parallel:
        raise ValueError("embeddings are not served under tensor parallelism (--tp); serve the model in one "
                         "process for them")
    if not 0 < tokens <= max_len:
        raise ValueError(f"an input of {tokens} tokens; embeddings take 1 to {max_len} (the context)")
