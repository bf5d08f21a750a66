"""Token ids to text deltas, stopping at the first stop string (which is not sent). Runs on the event loop,
never on the batcher's thread: a request's stop strings cost its own response time, not every request's
decode step (and requests.py bounds their number and length).
"""

from __future__ import annotations


class TextStream:
    """Decodes incrementally: ids[:r] are text already (`text_r`); each token decodes only ids[p:], with
    ids[p:r] as context (a tokenizer may spell a token differently at the start of a text), so a long
    completion costs linear, not quadratic, decoding.

    Text that may be the start of a stop string, or half a character's bytes, is held back until the next
    token tells; `rest()` releases it at the end.
    """

    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer, self.stop = tokenizer, [s for s in stop if s]
        self.longest = max((len(s) for s in self.stop), default=0)
        self.ids: list[int] = []
        self.sent, self.stopped = "", False
        self.text_r, self.p, self.r = "", 0, 0

    def _decode(self) -> str:
        """The text of all ids so far."""
        window = self.tokenizer.decode(self.ids[self.p:])
        prior = self.tokenizer.decode(self.ids[self.p:self.r])
        if window.startswith(prior):
            text = self.text_r + window[len(prior):]
        else:                                   # the context changed its own spelling: decode everything
            text = self.tokenizer.decode(self.ids)
        if not text.endswith("\ufffd"):        # whole characters: the next token starts from here
            self.text_r, self.p, self.r = text, self.r, len(self.ids)
        return text

    def _held(self, text: str) -> int:
        """How many trailing characters of `text` may begin a stop string (the longest such start)."""
        if not text:
            return 0
        last, held = text[-1], 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), held, -1):
                if s[k - 1] == last and text.endswith(s[:k]):
                    held = k
                    break
        return held

    def add(self, token: int) -> str:
        """The text this token makes sendable (maybe empty); sets `stopped` when a stop string completes."""
        self.ids.append(token)
        text = self._decode()
        tail = max(0, len(self.sent) - self.longest)          # where a stop string can start
        cut = min((i for i in (text.find(s, tail) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped, text = True, text[:cut]
        else:
            text = text.rstrip("\ufffd")        # a character still being spelled by its bytes: hold it back
            text = text[:len(text) - self._held(text)]
        delta = text[len(self.sent):] if text.startswith(self.sent) else ""
        self.sent = max(text, self.sent, key=len)
        return delta

    def rest(self) -> str:
        """The text held back, at the end of the sequence."""
        text = self._decode() if not self.stopped else self.sent
        delta, self.sent = text[len(self.sent):], text
        return delta
