"""Tokenizers: bytes (vocab 256, nothing to download) or a Hugging Face tokenizer.json."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np

from bunsan.models.hf import generation_eos_ids
from bunsan.models.model_dir import ROLES, read_json, regular_file


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocab 256, needs no files, never fails to encode."""

    vocab_size = 256
    eos_token_id = None
    stop_ids: list[int] = []
    identity = "byte"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    cuts = "anywhere"      # where a file may be cut for streaming (stream.py): bytes are bytes

    def encode_pieces(self, pieces: list[bytes]) -> list[np.ndarray]:
        return [np.frombuffer(p, dtype=np.uint8) for p in pieces]   # no per-byte Python work

    def separator_ids(self) -> list[int]:
        """What ends each document (file) of a corpus: a newline."""
        return [10]


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` via the ``tokenizers`` package. Its end token is the model's own
    (tokenizer_config.json's eos_token beside it: Qwen's <|im_end|>, Llama 3 Instruct's <|eot_id|>), else the
    first of the usual end-of-text tokens it has; `stop_ids` adds generation_config.json's eos_token_id
    (one id or a list), where generation ends."""

    _EOS_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|im_end|>")

    def __init__(self, path: str | os.PathLike):
        p = Path(path)
        if p.is_dir() and p.name != "tokenizer.json":      # (a folder holding one; not a folder in its place)
            p = p / "tokenizer.json"
        if not os.path.lexists(p):
            raise FileNotFoundError(f"tokenizer file not found: {p} (expected a Hugging Face tokenizer.json)")
        regular_file(p, ROLES["tokenizer.json"])       # (a pipe or a directory in its place: said, never opened)
        try:
            from tokenizers import Tokenizer
        except ImportError as e:
            raise ImportError(f"loading tokenizer {p} needs the 'tokenizers' package: "
                              "pip install tokenizers  (or pip install 'bunsan[hf]')") from e
        self.path = p
        try:
            self._tok = Tokenizer.from_file(str(p))
        except Exception as e:     # noqa: BLE001  (tokenizers raises a bare Exception for a bad file)
            raise ValueError(f"tokenizer {p} is not a Hugging Face tokenizer.json ({str(e)[:160]}); point at the "
                             "tokenizer.json a model directory holds (tokenizer.save() writes one)") from None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        ids = (self._tok.token_to_id(t) for t in self._EOS_CANDIDATES)
        self.text_end_id = next((i for i in ids if i is not None), None)     # between documents of a corpus
        own = self._configured_eos(p.parent / "tokenizer_config.json")
        self.eos_token_id = self._tok.token_to_id(own) if own else None
        if self.eos_token_id is None:
            self.eos_token_id = self.text_end_id
        first = [self.eos_token_id] if self.eos_token_id is not None else []
        self.stop_ids = first + sorted(generation_eos_ids(p.parent) - set(first))
        self.identity = "hf-" + hashlib.sha256(p.read_bytes()).hexdigest()[:16]
        if self.eos_token_id != self.text_end_id:     # examples end with it: cached tokens of another end differ
            self.identity += f"-eos{self.eos_token_id}"

    @staticmethod
    def _configured_eos(path: Path) -> str | None:
        """tokenizer_config.json's eos_token (a string, or {"content": ...}); None without the file or the field.
        A file that is not such JSON is refused (models/model_dir.py): another end token would train silently."""
        token = read_json(path).get("eos_token") if os.path.lexists(path) else None
        token = token.get("content") if isinstance(token, dict) else token
        return token if isinstance(token, str) and token else None

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    @property
    def cuts(self) -> str:
        """Where stream.py may cut a file and get the whole file's tokens: at line starts when nothing
        rewrites the text first and the pre-tokenizer splits at whitespace (byte-level BPE without a prefix
        space: GPT-2's, Llama 3's), else nowhere (a SentencePiece-style normalizer prepends to each piece)."""
        spec = read_json(self.path, role=ROLES["tokenizer.json"])
        pre = spec.get("pre_tokenizer") or {}
        steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
        whitespace_split = any(st.get("type") in ("ByteLevel", "Split", "Whitespace", "WhitespaceSplit")
                               for st in steps)
        no_prefix = all(not st.get("add_prefix_space", False) and st.get("type") != "Metaspace" for st in steps)
        return "lines" if spec.get("normalizer") is None and whitespace_split and no_prefix else "never"

    def encode_pieces(self, pieces: list[bytes]) -> list[list[int]]:
        """Each piece's ids; the batch is encoded on every core (tokenizers' encode_batch). Pieces are cut at
        newlines, so decoding each one alone never splits a UTF-8 character."""
        texts = [p.decode("utf-8", errors="replace") for p in pieces]
        return [enc.ids for enc in self._tok.encode_batch(texts, add_special_tokens=False)]

    def separator_ids(self) -> list[int]:
        """What ends each document (file): the end-of-text token, else a newline's tokens."""
        return [self.text_end_id] if self.text_end_id is not None else self.encode("\n")




def load_tokenizer(path: str | os.PathLike | None = None):
    """None or "byte" -> ByteTokenizer; otherwise a tokenizer.json file (or a dir holding one)."""
    if path is None or str(path) == "byte":
        return ByteTokenizer()
    return HFTokenizer(path)

