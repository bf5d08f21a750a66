"""How one sequence draws its next token: penalties and logit bias on the logits, then `generate`'s own
draw (temperature, top-k, top-p; greedy at temperature 0), plus the log-probabilities a client asked for.

Penalties follow OpenAI and vLLM: `presence_penalty` and `frequency_penalty` subtract from the logit of each
token generated so far (once, and once per time it appeared); `repetition_penalty` (Hugging Face's, as in
vLLM) divides a positive logit and multiplies a negative one of every token in the prompt or the output.
Log-probabilities are the model's own (log-softmax of the raw logits, before penalties and temperature), as
vLLM reports by default.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from bunsan.models.generate import next_token


@dataclass
class SamplingParams:
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None
    logprobs: int | None = None       # None: none; k: the chosen token's and the k most likely

    def penalised(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias)


END = -1         # a Token id that ends its sequence with no text: a complete grammar, no end token allowed


@dataclass
class Token:
    """One generated (or prompt) token: its id, and its log-probability and the top alternatives when asked;
    `final`: the sequence ends after it (its grammar is complete)."""
    id: int
    logprob: float | None = None
    top: list[tuple[int, float]] | None = None
    final: bool = False


def top_logprobs(logprobs: torch.Tensor, k: int) -> list[tuple[int, float]]:
    if k <= 0:
        return []
    values, ids = torch.topk(logprobs, min(k, logprobs.shape[-1]))
    return list(zip(ids.tolist(), values.tolist()))


class RowSampler:
    """One sequence's sampling state: its seeded generator and the token counts its penalties need."""

    def __init__(self, params: SamplingParams, prompt: list[int], vocab_size: int, constraint=None):
        """`constraint`: a structured.Constraint the tokens must follow (None: any)."""
        self.params, self.vocab_size, self.constraint = params, vocab_size, constraint
        self.generator = None if params.seed is None else torch.Generator().manual_seed(params.seed)
        counted = params.presence_penalty or params.frequency_penalty
        self.counts = torch.zeros(vocab_size, dtype=torch.float32) if counted else None
        self.seen, self.bias = None, None
        if params.repetition_penalty != 1.0:
            self.seen = torch.zeros(vocab_size, dtype=torch.bool)
            self.seen[torch.tensor(prompt, dtype=torch.long)] = True
        if params.logit_bias:
            self.bias = torch.zeros(vocab_size, dtype=torch.float32)
            self.bias[torch.tensor(list(params.logit_bias))] = torch.tensor(list(params.logit_bias.values()))

    @property
    def greedy(self) -> bool:
        """Its token is the argmax of the logits plus its bias: what draw_rows computes for many rows at once."""
        return self.params.temperature == 0 and self.constraint is None and self.params.logprobs is None and \
            self.counts is None and self.seen is None

    def _adjusted(self, logits: torch.Tensor) -> torch.Tensor:
        p = self.params
        if self.seen is not None:
            penalty = p.repetition_penalty
            logits = torch.where(self.seen, torch.where(logits > 0, logits / penalty, logits * penalty), logits)
        if self.counts is not None:
            logits = logits - (p.frequency_penalty * self.counts + p.presence_penalty * (self.counts > 0))
        if self.bias is not None:
            logits = logits + self.bias
        return logits

    def _min_p(self, logits: torch.Tensor) -> torch.Tensor:
        """Drop the tokens less likely than min_p times the most likely one (after temperature)."""
        floor = logits.max() + self.params.temperature * math.log(self.params.min_p)
        return logits.masked_fill(logits < floor, float("-inf"))

    def draw(self, logits: torch.Tensor) -> Token:
        """logits [vocab] (fp32, CPU) -> the next token, and its log-probabilities when asked."""
        p = self.params
        adjusted = self._adjusted(logits)
        if self.constraint is not None:          # only what the grammar takes next
            allowed = self.constraint.allowed(logits.shape[-1])
            if not bool(allowed.any()):
                return Token(END)                # only its end is left, and the vocabulary has no end token
            adjusted = adjusted.masked_fill(~allowed, float("-inf"))
        if p.min_p > 0 and p.temperature > 0:
            adjusted = self._min_p(adjusted)
        token = int(next_token(adjusted[None], p.temperature, p.top_k, self.generator, p.top_p)[0])
        self.note(token)
        final = False
        if self.constraint is not None:
            self.constraint.take(token)
            final = self.constraint.done()
        if p.logprobs is None:
            return Token(token, final=final)
        logprobs = torch.log_softmax(logits, dim=-1)
        return Token(token, float(logprobs[token]), top_logprobs(logprobs, p.logprobs), final)

    def note(self, token: int) -> None:
        """Count a token of the output (for the penalties)."""
        if self.counts is not None:
            self.counts[token] += 1
        if self.seen is not None:
            self.seen[token] = True


def draw_rows(requests: list, logits: torch.Tensor) -> list:
    """Each request's next token (a Token, or the exception its draw raised) from its row of logits [rows,
    vocab]: the greedy ones (no penalty but a logit bias, no grammar, no log-probabilities) by one argmax over
    their rows, the others one by one (the same choice as each one's own draw)."""
    out: list = [None] * len(requests)
    greedy = [j for j, r in enumerate(requests) if r.sampler is None or r.sampler.greedy]
    if greedy:
        rows = logits[greedy]
        biases = [(i, requests[j].sampler.bias) for i, j in enumerate(greedy)
                  if requests[j].sampler is not None and requests[j].sampler.bias is not None]
        if biases:
            rows[[i for i, _ in biases]] += torch.stack([b for _, b in biases])
        for j, token in zip(greedy, rows.argmax(dim=-1).tolist()):
            out[j] = Token(token)
    for j, r in enumerate(requests):
        if out[j] is None:
            try:
                out[j] = r.draw(logits[j])
            except Exception as e:        # this row's failure is its own
                out[j] = e
    return out


def prompt_logprobs(logits: torch.Tensor, ids: list[int], k: int) -> list[Token]:
    """Each prompt token's log-probability given the ones before (the first has none), with the top k: what
    `echo` with `logprobs` returns. logits [len(ids), vocab] from the prompt's prefill."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    out = [Token(ids[0])]
    for i in range(1, len(ids)):
        out.append(Token(ids[i], float(logprobs[i - 1, ids[i]]), top_logprobs(logprobs[i - 1], k)))
    return out
