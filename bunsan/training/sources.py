"""Where `bunsan train`'s batches come from: plain text as one token stream (data.format text, the cached
corpus) or records rendered to one example per row (the other formats: examples.py, example_batches.py)."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import numpy as np
import torch

from bunsan.comm import functional as world
from bunsan.comm.work import CommError, first_line
from bunsan.training.data import TokenBatches, TokenCache, default_corpus_files, load_tokenizer, resolve_paths
from bunsan.training.example_batches import example_rows, report
from bunsan.training.media_batches import example_batches
from bunsan.training.examples import Renderer, is_dataset_dir, read_records

__all__ = ["tokenizer_folder", "load_source", "corpus_tokens", "same_everywhere", "train_batches",
           "held_out_batches"]

HOST_BYTES = 64


def tokenizer_folder(cfg) -> str | None:
    """data.tokenizer; else, with train.init_from, the Hugging Face model's own tokenizer when it has one
    (a model trained on its own tokens, not bytes)."""
    if cfg.data.tokenizer is not None:
        return cfg.data.tokenizer
    init = cfg.train.init_from
    if init and os.path.lexists(Path(init) / "tokenizer.json"):     # (one that is no file: its reader says so)
        return init
    return None


def corpus_tokens(cache: TokenCache) -> np.ndarray:
    """The token stream, from a cache that each node builds for itself (its local rank 0, when missing: a
    cache directory need not be shared) while the others wait in a collective, bounded by train.timeout_s;
    then every rank checks that all of them tokenised the same corpus with the same tokenizer."""
    distributed = world.is_initialized() and world.get_world_size() > 1
    if world.get_local_rank() == 0 and not cache.path.exists():
        cache.build()
    if distributed:
        try:
            world.barrier()
            same_everywhere(cache.key, "corpus and tokenizer (data.paths' content, data.tokenizer)")
        except RuntimeError as e:     # gloo's timeout (the process group's: train.timeout_s) or a lost peer
            raise CommError(f"rank {world.get_rank()} on {socket.gethostname()}: waiting for every node's token "
                            f"cache failed ({first_line(e)}): each "
                            "node's local rank 0 tokenises the corpus while the other ranks wait, at most "
                            "train.timeout_s: a node died here, or its corpus takes longer to tokenise (raise "
                            "train.timeout_s for the first run; later runs find the cache)") from None
    if not cache.path.exists():
        raise FileNotFoundError(f"token cache {cache.path} is missing on {socket.gethostname()} after this "
                                "node's local rank 0 built it: is data.cache_dir the same directory for every "
                                "rank of a node?")
    return np.load(cache.path, mmap_mode="r")


def same_everywhere(key: str, what: str) -> None:
    """Every rank's `key` (hex) equals rank 0's, else an error naming the hosts and ranks that differ."""
    device = torch.device("cuda", torch.cuda.current_device()) if world.get_backend() == "nccl" \
        else torch.device("cpu")
    host = socket.gethostname().encode()[:HOST_BYTES]
    mine = torch.tensor(list(bytes.fromhex(key)) + list(host) + [0] * (HOST_BYTES - len(host)),
                        dtype=torch.int32, device=device)
    every = [torch.empty_like(mine) for _ in range(world.get_world_size())]
    world.all_gather(every, mine)
    rows = [t.tolist() for t in every]
    n = len(bytes.fromhex(key))
    differ = [r for r, row in enumerate(rows) if row[:n] != rows[0][:n]]
    if differ:
        hosts = {bytes(c for c in rows[r][n:] if c).decode(errors="replace") for r in differ}
        raise ValueError(f"rank(s) {differ[:8]} on {sorted(hosts)} see another {what} than rank 0 on "
                         f"{bytes(c for c in rows[0][n:] if c).decode(errors='replace')}: give every node the "
                         "same files and tokenizer (their bytes must match; paths and mtimes may differ)")


def _record_paths(paths: list[str]) -> list[Path]:
    """Saved datasets directories as they are; every other path expanded to its files."""
    out: list[Path] = []
    for p in paths:
        out.extend([Path(p)] if is_dataset_dir(Path(p)) else resolve_paths([p], text=False))
    return out


def load_source(cfg, rank: int):
    """(tokenizer, what the batches are cut from: the token stream, or the example rows)."""
    folder = tokenizer_folder(cfg)
    tokenizer = load_tokenizer(folder)
    if cfg.data.format == "text":
        files = resolve_paths(cfg.data.paths) if cfg.data.paths else default_corpus_files()
        return tokenizer, corpus_tokens(TokenCache(files, tokenizer, cfg.data.cache_dir, cfg.data.max_bytes))
    if cfg.train.objective != "lm" and cfg.data.format != "preference":
        raise ValueError(f"train.objective {cfg.train.objective} with data.format {cfg.data.format}: it reads "
                         "preference pairs; set data.format preference (records of prompt, chosen, rejected)")
    if not cfg.data.paths:
        raise ValueError(f"data.format {cfg.data.format} reads records: give data.paths (JSONL, JSON, Parquet "
                         "files or a saved datasets directory)")
    renderer = Renderer(cfg.data.format, tokenizer, Path(folder) if folder else None, cfg.data.fields,
                        cfg.data.train_on_prompt, cfg.data.on_bad_record, seq_len=cfg.data.seq_len)
    pad = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    records = read_records(_record_paths(cfg.data.paths), cfg.data.on_bad_record)
    if cfg.data.format == "preference":
        from bunsan.training.preference_data import pair_rows
        rows = pair_rows(records, renderer, cfg.data.seq_len, pad,
                         cfg.dpo.reference if cfg.train.objective == "dpo" else None)
    else:
        rows = example_rows(records, renderer, cfg.data.seq_len, pad, packing=cfg.data.packing,
                            workers=cfg.data.tokenize_workers)
    if rank == 0:
        report(rows, cfg.data.seq_len)
    return tokenizer, rows


def train_batches(source, cfg, engine) -> TokenBatches:
    if cfg.data.format == "text":
        return TokenBatches(source, cfg.data.seq_len, engine.train_batch_size, engine.dp_rank, engine.dp_size,
                            seed=cfg.train.seed, val_fraction=cfg.data.val_fraction)
    return example_batches(source, engine.train_batch_size, engine.dp_rank, engine.dp_size, seed=cfg.train.seed,
                           val_fraction=cfg.data.val_fraction)


def held_out_batches(source, cfg, engine) -> TokenBatches | None:
    """The held-out split, or None when there is none or it is smaller than one global batch."""
    if not cfg.data.val_fraction:
        return None
    try:
        if cfg.data.format == "text":
            return TokenBatches(source, cfg.data.seq_len, engine.train_batch_size, engine.dp_rank, engine.dp_size,
                                seed=cfg.train.seed, split="val", val_fraction=cfg.data.val_fraction)
        return example_batches(source, engine.train_batch_size, engine.dp_rank, engine.dp_size, seed=cfg.train.seed,
                               split="val", val_fraction=cfg.data.val_fraction)
    except ValueError:
        return None
