"""The longest common prefix of two prompts: the batcher waits a step with a prompt that shares whole KV
blocks with one being prefilled beside it, to take them from the prefix cache (blocks.py) once written."""

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
