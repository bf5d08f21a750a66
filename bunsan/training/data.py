"""Text -> tokens -> deterministic, resumable, data-parallel batches.

Tokens live in one flat memory-mapped ``.npy`` per (files, tokenizer) under a
cache dir. Batches are windows of ``seq_len + 1`` tokens drawn from a seeded
per-epoch permutation; the sample position is global, so a run can resume on a
different data-parallel size and still read the same samples in the same order.
"""
from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import socket
import time
import uuid
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from bunsan.training.paths import default_corpus_files, resolve_paths  # noqa: F401  (re-exported)
from bunsan.training.stream import write_token_file
from bunsan.training.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer  # noqa: F401  (re-exported)

_CACHE_VERSION = 1  # bump when the on-disk format or document separation changes


def default_cache_dir() -> Path:
    return Path(os.environ.get("BUNSAN_CACHE", Path.home() / ".cache" / "bunsan")) / "tokens"


class FileDigests:
    """Each file's content digest, remembered by (path, size, mtime) so that a start re-reads only files
    that changed."""

    def __init__(self, path: Path):
        self.path, self.changed = path, False
        try:
            self.known = json.loads(path.read_text()) if path.is_file() else {}
        except (OSError, ValueError):
            self.known = {}

    def digest(self, f: Path) -> str:
        # (keyed by host too: a cache directory shared by nodes must not vouch for another node's file)
        st, real = f.stat(), f"{socket.gethostname()}:{f.resolve()}"
        hit = self.known.get(real)
        if isinstance(hit, list) and hit[:2] == [st.st_size, st.st_mtime_ns]:
            return hit[2]
        h = hashlib.blake2b(digest_size=16)
        h.update(str(st.st_size).encode() + b":")
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 22), b""):
                h.update(block)
        self.known[real], self.changed = [st.st_size, st.st_mtime_ns, h.hexdigest()], True
        return h.hexdigest()

    def save(self) -> None:
        if not self.changed:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}")
            tmp.write_text(json.dumps(self.known))
            os.replace(tmp, self.path)
        except OSError:
            pass      # a read-only cache directory: the digests are computed again next time


class TokenCache:
    """Tokenise ``files`` once into a flat memory-mapped ``.npy``.

    The file name is a hash of the files' content, the tokenizer identity and
    max_bytes, so an edited file or another tokenizer gets a new cache, and
    machines with the same corpus agree on it. Writers
    build into a private temp file and ``os.replace`` it into place: readers never
    see a partial file, and two processes building at once both succeed (the last
    rename wins with identical bytes).
    """

    def __init__(self, files, tokenizer=None, cache_dir=None, max_bytes: int | None = None):
        self.files = [Path(f) for f in files]
        if not self.files:
            raise ValueError("TokenCache needs at least one file")
        self.tokenizer = tokenizer or ByteTokenizer()
        self.cache_dir = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
        if self.cache_dir.exists() and not self.cache_dir.is_dir():
            raise ValueError(f"data.cache_dir {str(self.cache_dir)!r} is a file, not a directory: the token cache "
                             "lives in a directory; set data.cache_dir to one (it is made if missing)")
        self.max_bytes = max_bytes
        self.builds = 0  # how many times this object tokenised (tests check reuse)

    @functools.cached_property
    def key(self) -> str:
        """A hash of the corpus' content (each file's bytes, in order), the tokenizer and max_bytes: the same
        on every machine that has the same files, wherever they live and whatever their mtimes."""
        h = hashlib.blake2b(digest_size=12)
        h.update(json.dumps([_CACHE_VERSION, self.tokenizer.identity, self.max_bytes]).encode())
        memo = FileDigests(self.cache_dir / "file-digests.json")
        for f in self.files:
            h.update(memo.digest(f).encode())
        memo.save()
        return h.hexdigest()

    @property
    def path(self) -> Path:
        return self.cache_dir / f"{self.tokenizer.identity}-{self.key}.npy"

    def build(self) -> Path:
        """Tokenise (streaming, bounded memory: stream.py) and atomically publish; returns the cache path."""
        dtype = np.uint16 if self.tokenizer.vocab_size <= 2**16 else np.uint32
        dest = self.path
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            write_token_file(tmp, self.files, self.tokenizer, self.max_bytes, dtype)
            os.replace(tmp, dest)
        finally:
            tmp.unlink(missing_ok=True)
        self.builds += 1
        return dest

    def load(self, build: bool = True, timeout: float = 600.0) -> np.ndarray:
        """The token array (read-only memmap). With ``build=False`` wait for another
        process (e.g. rank 0) to publish it, up to ``timeout`` seconds."""
        path = self.path
        if not path.exists():
            if build:
                self.build()
            else:
                deadline = time.monotonic() + timeout
                while not path.exists():
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"waited {timeout:.0f}s for token cache {path} "
                                           "that another rank should build; did rank 0 fail?")
                    time.sleep(0.2)
        return np.load(path, mmap_mode="r")


def load_tokens(files=None, tokenizer=None, cache_dir=None, max_bytes=None, build=True) -> np.ndarray:
    """Convenience: default corpus and byte tokenizer unless given."""
    files = default_corpus_files() if files is None else resolve_paths(files)
    return TokenCache(files, tokenizer, cache_dir, max_bytes).load(build=build)


def unigram_entropy(tokens: np.ndarray) -> float:
    """Entropy of the token frequency distribution in nats: the loss of a model
    that predicts every token from global counts alone."""
    counts = np.bincount(np.asarray(tokens).ravel())
    counts = counts[counts > 0].astype(np.float64)
    p = counts / counts.sum()
    return float(-(p * np.log(p)).sum())



class TokenBatches:
    """Deterministic data-parallel batches of non-overlapping ``seq_len + 1`` windows.

    Global windows [pos, pos + G) of the (per-epoch permuted) window order form
    one step; rank r takes rows [r*G/dp, (r+1)*G/dp) of it, so ranks read
    disjoint data and concatenating their rows gives the dp=1 batch. ``position``
    counts global samples, so resume works across data-parallel sizes.

        windows:  | w0 | w1 | w2 | ... | w_{n-val-1} | val ... |
        step k:   perm_e[kG .. kG+G)  ->  rank0 | rank1 | ... (G/dp rows each)
    """

    target_key = "labels"     # the shifted targets' key; "shift_labels" for a transformers model (hf_model.py)

    def __init__(self, tokens: np.ndarray, seq_len: int, global_batch: int, dp_rank: int = 0,
                 dp_size: int = 1, seed: int = 0, split: str = "train", val_fraction: float = 0.01):
        if split not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        if seq_len <= 0 or global_batch <= 0:
            raise ValueError(f"seq_len ({seq_len}) and global_batch ({global_batch}) must be positive")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} out of range for dp_size {dp_size}")
        if global_batch % dp_size:
            raise ValueError(f"global batch {global_batch} is not divisible by data-parallel size {dp_size}; "
                             f"use a multiple of {dp_size} (e.g. {math.ceil(global_batch / dp_size) * dp_size})")
        if not 0 <= val_fraction < 1:
            raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
        self.tokens, self.seq_len, self.global_batch = tokens, seq_len, global_batch
        self.dp_rank, self.dp_size, self.seed, self.split = dp_rank, dp_size, seed, split
        self.val_fraction = val_fraction
        w = seq_len + 1
        n = len(tokens) // w
        n_val = math.ceil(n * val_fraction) if val_fraction > 0 else 0
        self.n_windows_total = n
        self.first, self.n_windows = (0, n - n_val) if split == "train" else (n - n_val, n_val)
        if self.n_windows < global_batch:
            raise ValueError(
                f"corpus too small for the {split} split: {len(tokens):,} tokens make {n:,} windows of "
                f"seq_len+1 = {w} ({self.n_windows:,} in {split}, val_fraction {val_fraction}), fewer than "
                f"global batch {global_batch}; add data, or lower seq_len or the batch size")
        self.micro = global_batch // dp_size
        self.position = 0
        self._perm_cache: dict[int, np.ndarray] = {}

    @property
    def steps_per_epoch(self) -> int:
        return self.n_windows // self.global_batch

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perm_cache:
            if self.split == "val":  # val keeps corpus order so evaluations compare like with like
                perm = np.arange(self.n_windows)
            else:
                perm = np.random.default_rng(self.seed + epoch).permutation(self.n_windows)
            if len(self._perm_cache) >= 2:  # a step spans at most two epochs
                self._perm_cache.pop(min(self._perm_cache))
            self._perm_cache[epoch] = perm
        return self._perm_cache[epoch]

    def window_ids(self, position: int) -> np.ndarray:
        """This rank's window indices for the step starting at global sample ``position``."""
        g = np.arange(position + self.dp_rank * self.micro, position + (self.dp_rank + 1) * self.micro)
        epochs, offs = np.divmod(g, self.n_windows)
        out = np.empty(len(g), dtype=np.int64)
        for e in np.unique(epochs):
            sel = epochs == e
            out[sel] = self._perm(int(e))[offs[sel]]
        return out + self.first

    def batch_at(self, position: int) -> dict[str, torch.Tensor]:
        w = self.seq_len + 1
        view = self.tokens[: self.n_windows_total * w].reshape(self.n_windows_total, w)
        rows = torch.from_numpy(np.asarray(view[self.window_ids(position)], dtype=np.int64))
        return {"input_ids": rows[:, :-1].contiguous(), self.target_key: rows[:, 1:].contiguous()}

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        batch = self.batch_at(self.position)
        self.position += self.global_batch
        return batch

    def state_dict(self) -> dict:
        return {"position": self.position, "seed": self.seed, "seq_len": self.seq_len,
                "split": self.split, "n_windows": self.n_windows}

    def load_state_dict(self, d: dict) -> None:
        for k in ("seed", "seq_len", "split", "n_windows"):
            if k in d and d[k] != getattr(self, k):
                raise ValueError(f"data state mismatch: checkpoint {k}={d[k]!r}, current {k}={getattr(self, k)!r}; "
                                 "the corpus, seed or seq_len changed since the checkpoint")
        position = d.get("position")
        if isinstance(position, bool) or not isinstance(position, int) or position < 0:
            raise ValueError(f"data state position {str(position)[:40]!r} in the checkpoint is not a non-negative "
                             "integer; the checkpoint's client state is damaged")
        self.position = position

    def __getstate__(self):
        # A memmap would be pickled by value into every DataLoader worker; send its path.
        state = dict(self.__dict__, _perm_cache={})
        t, root = self.tokens, self.tokens
        while isinstance(root.base, np.ndarray):  # a slice's .offset is its parent's: find the mapping
            root = root.base
        if isinstance(root, np.memmap) and root.filename and t.ndim == 1 and t.flags.c_contiguous:
            off = root.offset + t.ctypes.data - root.ctypes.data
            state["tokens"] = ("__memmap__", root.filename, off, t.dtype.str, t.shape)
        return state

    def __setstate__(self, state):
        t = state["tokens"]
        if isinstance(t, tuple) and t[0] == "__memmap__":
            _, fn, off, dt, shape = t
            state["tokens"] = np.memmap(fn, dtype=np.dtype(dt), mode="r", offset=off, shape=shape)
        self.__dict__.update(state)


class _StepDataset(torch.utils.data.Dataset):
    """Map-style view: item k is the batch at ``start + k * G`` (order fixed by index)."""

    def __init__(self, batches: TokenBatches, start: int):
        self.batches, self.start = batches, start

    def __len__(self) -> int:
        return 2**62  # effectively endless; the sampler decides what is read

    def __getitem__(self, k: int):
        return self.batches.batch_at(self.start + k * self.batches.global_batch)


class _Counting(torch.utils.data.Sampler):
    def __iter__(self):
        k = 0
        while True:
            yield k
            k += 1


class BatchLoader:
    """Yields ``batches``' sequence, optionally from worker processes, and keeps
    ``batches.position`` in step with what was handed out (so checkpoints resume)."""

    def __init__(self, batches: TokenBatches, num_workers: int = 0, pin_memory: bool = False,
                 prefetch_factor: int = 2):
        self.batches, self.num_workers = batches, num_workers
        self.pin_memory, self.prefetch_factor = pin_memory, prefetch_factor

    def __iter__(self):
        b = self.batches
        if self.num_workers <= 0:
            pin = self.pin_memory and torch.cuda.is_available()
            for batch in b:
                yield {k: v.pin_memory() for k, v in batch.items()} if pin else batch
            return
        loader = torch.utils.data.DataLoader(
            _StepDataset(b, b.position), batch_size=None, sampler=_Counting(),
            num_workers=self.num_workers, pin_memory=self.pin_memory and torch.cuda.is_available(),
            prefetch_factor=self.prefetch_factor, persistent_workers=False)
        for batch in loader:  # DataLoader returns items in index order
            b.position += b.global_batch
            yield batch

    def state_dict(self) -> dict:
        return self.batches.state_dict()

    def load_state_dict(self, d: dict) -> None:
        self.batches.load_state_dict(d)  # takes effect at the next iter()


def make_loader(batches: TokenBatches, num_workers: int = 0, pin_memory: bool = False,
                prefetch_factor: int = 2) -> BatchLoader:
    return BatchLoader(batches, num_workers, pin_memory, prefetch_factor)
