"""Where `bunsan train`'s batches come from: plain text as one token stream (data.format text, the cached
corpus) or records rendered to one example per row (the other formats: examples.py, example_batches.py)."""

from __future__ import annotations

from pathlib import Path

from bunsan.training.data import TokenBatches, load_tokenizer, load_tokens, resolve_paths
from bunsan.training.example_batches import ExampleBatches, example_rows, report
from bunsan.training.examples import Renderer, is_dataset_dir, read_records

__all__ = ["tokenizer_folder", "load_source", "train_batches", "held_out_batches"]


def tokenizer_folder(cfg) -> str | None:
    """data.tokenizer; else, with train.init_from, the Hugging Face model's own tokenizer when it has one
    (a model trained on its own tokens, not bytes)."""
    if cfg.data.tokenizer is not None:
        return cfg.data.tokenizer
    init = cfg.train.init_from
    if init and (Path(init) / "tokenizer.json").is_file():
        return init
    return None


def _record_paths(paths: list[str]) -> list[Path]:
    """Saved datasets directories as they are; every other path expanded to its files."""
    out: list[Path] = []
    for p in paths:
        out.extend([Path(p)] if is_dataset_dir(Path(p)) else resolve_paths([p]))
    return out


def load_source(cfg, rank: int):
    """(tokenizer, what the batches are cut from: the token stream, or the example rows)."""
    folder = tokenizer_folder(cfg)
    tokenizer = load_tokenizer(folder)
    if cfg.data.format == "text":
        files = resolve_paths(cfg.data.paths) if cfg.data.paths else None
        # Rank 0 tokenises (once, cached); the others wait for the cache file to appear and map it.
        return tokenizer, load_tokens(files, tokenizer, cfg.data.cache_dir, cfg.data.max_bytes, build=rank == 0)
    if not cfg.data.paths:
        raise ValueError(f"data.format {cfg.data.format} reads records: give data.paths (JSONL, JSON, Parquet "
                         "files or a saved datasets directory)")
    renderer = Renderer(cfg.data.format, tokenizer, Path(folder) if folder else None, cfg.data.fields,
                        cfg.data.train_on_prompt)
    pad = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    rows = example_rows(read_records(_record_paths(cfg.data.paths)), renderer, cfg.data.seq_len, pad)
    if rank == 0:
        report(rows, cfg.data.seq_len)
    return tokenizer, rows


def train_batches(source, cfg, engine) -> TokenBatches:
    if cfg.data.format == "text":
        return TokenBatches(source, cfg.data.seq_len, engine.train_batch_size, engine.dp_rank, engine.dp_size,
                            seed=cfg.train.seed, val_fraction=cfg.data.val_fraction)
    return ExampleBatches(source, engine.train_batch_size, engine.dp_rank, engine.dp_size, seed=cfg.train.seed,
                          val_fraction=cfg.data.val_fraction)


def held_out_batches(source, cfg, engine) -> TokenBatches | None:
    """The held-out split, or None when there is none or it is smaller than one global batch."""
    if not cfg.data.val_fraction:
        return None
    try:
        if cfg.data.format == "text":
            return TokenBatches(source, cfg.data.seq_len, engine.train_batch_size, engine.dp_rank, engine.dp_size,
                                seed=cfg.train.seed, split="val", val_fraction=cfg.data.val_fraction)
        return ExampleBatches(source, engine.train_batch_size, engine.dp_rank, engine.dp_size, seed=cfg.train.seed,
                              split="val", val_fraction=cfg.data.val_fraction)
    except ValueError:
        return None
