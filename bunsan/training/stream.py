"""Tokenising a corpus in one streaming pass, in bounded memory, into the token cache's `.npy`.

Files are read in pieces of about PIECE bytes and encoded a batch at a time, the tokens appended to a
temporary file; the `.npy` is then written from it in blocks. Memory holds one batch of text and its tokens,
whatever the corpus' size (a corpus larger than RAM works); disk holds the tokens twice until the end.

A piece is a whole file when it fits. A larger file is cut anywhere for byte tokens (the same however it
is cut); for a Hugging Face tokenizer at line starts (after a newline followed by a character that is not
whitespace) when nothing rewrites the text and its pre-tokenizer splits at whitespace (GPT-2's, Llama 3's
byte-level BPE: a word never spans such a cut), else never: the file is one piece (a SentencePiece-style
normalizer would prepend to each piece, so its tokens would differ). The tokenizers package encodes a
batch on every core.
"""

from __future__ import annotations

import codecs
import os
import shutil
import sys
from pathlib import Path
from typing import Iterator

import numpy as np

__all__ = ["PIECE", "write_token_file"]

PIECE = 4 << 20          # bytes of text per piece, and about that per encoded batch
BLOCK = 8 << 20          # bytes copied at a time into the .npy


def _pieces(path: Path, limit: float, cuts: str) -> Iterator[bytes]:
    """The file's bytes (at most `limit`) in pieces of about PIECE: cut anywhere (bytes), at line starts, or
    never (the whole file: a tokenizer whose tokens would change at a cut)."""
    left, parts, held = limit, [], 0
    text = TextCheck(path)
    with open(path, "rb") as f:
        while left > 0:
            block = f.read(int(min(PIECE, left)))
            if not block:
                text.end()
                break
            text.feed(block)
            left -= len(block)
            parts.append(block)
            held += len(block)
            if cuts == "never" or held < PIECE:
                continue
            if cuts == "anywhere":
                yield b"".join(parts)
                parts, held = [], 0
                continue
            cut = _line_start_cut(block)     # the last line start in the newest block: no rescans of the rest
            if cut > 0:
                data = b"".join(parts)
                end = len(data) - len(block) + cut
                yield data[:end]
                parts, held = [data[end:]], len(data) - end
    if parts:
        yield b"".join(parts)


class TextCheck:
    """A corpus file is UTF-8 text: a NUL byte (a binary or sparse file) or a byte sequence that is not UTF-8
    (latin-1 text) is an error naming the file, the offset and the fix, never trained on as bytes."""

    def __init__(self, path: Path):
        self.path, self.seen = path, 0
        self.decoder = codecs.getincrementaldecoder("utf-8")()

    def feed(self, block: bytes, final: bool = False) -> None:
        nul = block.find(b"\0")
        if nul >= 0:
            raise ValueError(f"data file {self.path} is not text: a NUL byte at offset {self.seen + nul:,} (a "
                             "binary or sparse file); bunsan trains on UTF-8 text: remove it from the data paths, "
                             "or give records with --format")
        try:
            self.decoder.decode(block, final)
        except UnicodeDecodeError as e:
            at = self.seen + max(0, e.start - len(self.decoder.getstate()[0]))
            raise ValueError(f"data file {self.path} is not UTF-8: byte 0x{e.object[e.start]:02x} near offset "
                             f"{at:,} ({e.reason}); convert it (iconv -f latin1 -t utf-8 {self.path.name} > "
                             "new) or remove it from the data paths") from None
        self.seen += len(block)

    def end(self) -> None:
        self.feed(b"", final=True)


def check_text_start(path: Path, nbytes: int = 1 << 16) -> None:
    """The first `nbytes` of a file pass TextCheck: a binary file is refused before it is read whole."""
    with open(path, "rb") as f:
        head = f.read(nbytes)
    check = TextCheck(path)
    check.feed(head)
    if len(head) < nbytes:
        check.end()


def _line_start_cut(data: bytes) -> int:
    """The end of the last line of `data` that a non-whitespace character follows; 0 if there is none."""
    i = len(data) - 1
    while True:
        i = data.rfind(b"\n", 0, i)
        if i < 0 or i + 1 >= len(data):
            return 0
        if not data[i + 1:i + 2].isspace():
            return i + 1


def _batches(files: list[Path], max_bytes: int | None, cuts: str) -> Iterator[list[tuple[bytes, bool]]]:
    """[(piece, it ends its file)] of about PIECE bytes each, in corpus order."""
    batch, size = [], 0
    left = float("inf") if max_bytes is None else max_bytes
    for f in files:
        if left <= 0:
            break
        pieces = _pieces(f, left, cuts)
        piece = next(pieces, b"")
        while piece is not None:         # one piece of look-ahead: the last one ends the file
            following = next(pieces, None)
            left -= len(piece)
            batch.append((piece, following is None))
            size += len(piece)
            if size >= PIECE:
                yield batch
                batch, size = [], 0
            piece = following
    if batch:
        yield batch


def write_token_file(dest: Path, files: list[Path], tokenizer, max_bytes: int | None, dtype,
                     show_progress: bool = True) -> int:
    """Tokenise `files` (each ends with the tokenizer's separator) into the `.npy` at dest (a fresh temporary
    path); the number of tokens."""
    total = sum(f.stat().st_size for f in files)
    total = min(total, max_bytes) if max_bytes is not None else total
    raw = dest.with_name(dest.name + ".raw")
    done, shown, count = 0, 0, 0
    separator = np.asarray(tokenizer.separator_ids(), dtype=dtype)
    try:
        with open(raw, "wb") as out:
            for batch in _batches(files, max_bytes, getattr(tokenizer, "cuts", "never")):
                for (piece, ends), ids in zip(batch, tokenizer.encode_pieces([p for p, _ in batch])):
                    np.asarray(ids, dtype=dtype).tofile(out)
                    count += len(ids)
                    if ends:
                        separator.tofile(out)
                        count += len(separator)
                    done += len(piece)
                if show_progress and total > 4 * PIECE and done - shown >= total / 10:
                    shown = done
                    print(f"bunsan: tokenised {done / 2**20:,.0f} of {total / 2**20:,.0f} MiB "
                          f"({done / total:.0%})", file=sys.stderr, flush=True)
        # The .npy: its header, then the tokens copied through a small buffer (a memory map of either file
        # would make every page of it resident in this process).
        with open(dest, "wb") as fh, open(raw, "rb") as src:
            header = {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)), "fortran_order": False,
                      "shape": (count,)}
            np.lib.format.write_array_header_2_0(fh, header)
            shutil.copyfileobj(src, fh, BLOCK)
            fh.flush()
            os.fsync(fh.fileno())
    finally:
        raw.unlink(missing_ok=True)
    return count
