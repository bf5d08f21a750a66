"""Prefix reuse: which tokens each slot of the KV cache holds keys and values for, and where a new prompt
finds the longest run of them it can reuse (as vLLM's prefix caching and Ollama do, at slot granularity).

A finished request leaves its slot's keys and values in place; the next prompt that starts with the same
tokens (a system prompt, a chat's earlier turns, the n sequences of one prompt) takes that slot and prefills
only what follows. A prefix held by a running request's slot is copied into a free slot instead.
"""

from __future__ import annotations


def common_prefix(a: list[int], b: list[int]) -> int:
    """The length of the longest common prefix of two token lists (slice comparisons run in C: a binary
    search over them costs O(n log n) element compares, never a Python loop over the tokens)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n                       # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class SlotTokens:
    """The tokens whose keys and values each slot holds, in order from position 0."""

    def __init__(self, slots: int):
        self.tokens: list[list[int]] = [[] for _ in range(slots)]

    def best(self, ids: list[int], slots, usable: int) -> tuple[int, int]:
        """(slot, tokens reusable) of the slot among `slots` sharing the longest prefix with `ids`, at most
        `usable` tokens (a prompt keeps at least its last token to prefill: its logits start the answer);
        (-1, 0) when none shares any."""
        best, length = -1, 0
        for s in slots:
            n = min(common_prefix(self.tokens[s], ids), usable)
            if n > length:
                best, length = s, n
        return best, length

    def keep(self, slot: int, n: int) -> None:
        del self.tokens[slot][n:]

    def set(self, slot: int, ids: list[int]) -> None:
        self.tokens[slot] = list(ids)

    def append(self, slot: int, token: int) -> None:
        self.tokens[slot].append(token)
