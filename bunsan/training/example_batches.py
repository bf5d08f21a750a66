"""Rendered examples as training rows: one example per row of seq_len + 1 tokens, padded (labels -100) or cut
to fit, or with data.packing several per row (document_ids tell the model where each one starts), and batched as the corpus is (TokenBatches: a seeded permutation per epoch, each data-parallel rank its
rows of every step, the position in the checkpoint, a held-out split of the last examples).

The loss is the mean over the trained tokens of the whole global batch (the engine counts labels != -100
over every rank), so padding changes nothing but the work done.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import numpy as np
import torch

from bunsan.training.data import TokenBatches

__all__ = ["ExampleRows", "example_rows", "ExampleBatches"]

IGNORE = -100


@dataclass
class ExampleRows:
    ids: np.ndarray        # [rows, seq_len + 1]
    trained: np.ndarray    # [rows, seq_len + 1], bool: the loss is taken on predicting this token
    cut: int               # examples longer than a row, cut to it
    dropped: int           # examples with no trained token left in their row (said, not used)
    skipped: list = None   # (data.on_bad_record: skip) why each refused record was left out
    documents: np.ndarray | None = None   # packed: [rows, seq_len + 1] each token's document in its row
    examples: int = 0      # examples in the rows (a packed row holds several)
    pairs: bool = False    # preference pairs: rows 2k and 2k+1 are a pair's chosen and rejected (one window)
    ref_logps: np.ndarray | None = None   # pairs: each row's reference log-prob (dpo.reference records)
    media: list | None = None     # multimodal chat: each row's MediaSpec (its media, processed when batched)
    media_chat: object = None     # ... and the processor that renders them (media_chat.py)


def _render(job):
    renderer, chunk = job
    return [renderer.render_or_skip(rec, where) for where, rec in chunk]


def rendered(records, renderer, workers: int = 1):
    """(ids, trained) of every record, in order, or (None, why) for one skipped; with workers > 1 rendered in
    that many processes."""
    if workers <= 1:
        for where, rec in records:
            yield renderer.render_or_skip(rec, where)
        return
    import multiprocessing
    items = list(records)
    size = max(1, min(256, len(items) // (4 * workers) or 1))
    jobs = [(renderer, items[i:i + size]) for i in range(0, len(items), size)]
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        for part in pool.imap(_render, jobs):
            yield from part


def example_rows(records, renderer, seq_len: int, pad_id: int, packing: bool = False,
                 workers: int = 1) -> ExampleRows:
    """One example per row, padded; with `packing`, examples in file order fill each row while they fit
    (a document's first token is never a target: it would be predicted from the document before). A
    multimodal chat renderer's examples carry their media (media_chat.py): one per row, never packed."""
    w = seq_len + 1
    ids, trained, docs, cut, dropped, used, skipped, media = [], [], [], 0, 0, 0, [], []
    for out in rendered(records, renderer, workers):
        toks, mask = out[0], out[1]
        if toks is None:
            skipped.append(mask)
            continue
        if len(out) > 2 and packing:
            raise ValueError(f"data.packing with multimodal chat records ({out[2].where}): each row's images or "
                             "audio go with its tokens, one example per row; set data.packing false")
        if len(toks) > w:
            toks, mask, cut = toks[:w], mask[:w], cut + 1
        if not any(mask[1:]):         # (the first token is never predicted)
            dropped += 1
            continue
        used += 1
        mask = [False] + list(mask[1:])
        if packing and ids and len(ids[-1]) + len(toks) <= w:
            ids[-1] += toks
            trained[-1] += mask
            docs[-1] += [docs[-1][-1] + 1] * len(toks)
        else:
            ids.append(list(toks))
            trained.append(mask)
            docs.append([0] * len(toks))
            media.append(out[2] if len(out) > 2 else None)
    if not ids:
        raise ValueError(f"no example has a token to train on ({dropped} had none left within seq_len+1 = {w}"
                         f"{f', {len(skipped)} were skipped as bad records, e.g. {skipped[0]}' if skipped else ''}); "
                         "check data.format and data.fields, or raise data.seq_len")
    for row, mask, doc in zip(ids, trained, docs):      # padding: a document of its own, never trained
        n = w - len(row)
        row += [pad_id] * n
        mask += [False] * n
        doc += [doc[-1] + 1] * n
    dtype = np.int32 if max(max(r) for r in ids) < 2 ** 31 else np.int64
    multimodal = getattr(renderer, "media", None) is not None
    rows = ExampleRows(np.asarray(ids, dtype=dtype), np.asarray(trained, dtype=bool), cut, dropped, skipped,
                       np.asarray(docs, dtype=np.int32) if packing else None, used,
                       media=media if multimodal else None, media_chat=renderer.media if multimodal else None)
    if multimodal:
        from bunsan.training.media_chat import check_media_rows
        check_media_rows(rows)
    return rows


def report(rows: ExampleRows, seq_len: int) -> None:
    skipped = rows.skipped or []
    n = rows.examples + rows.dropped + len(skipped)
    notes = []
    if skipped:
        notes.append(f"{len(skipped)} bad record(s) skipped (data.on_bad_record: skip), the first: {skipped[0]}")
    if rows.cut:
        notes.append(f"{rows.cut} cut to seq_len+1 = {seq_len + 1} tokens")
    if rows.dropped:
        notes.append(f"{rows.dropped} left out (no trained token within the row)")
    filled = rows.trained.sum() / rows.trained.size
    packed = f" packed into {len(rows.ids):,} rows" if rows.documents is not None else ""
    print(f"bunsan train: {n:,} examples, {rows.examples:,} used{packed}{': ' + ', '.join(notes) if notes else ''}; "
          f"{filled:.0%} of the row tokens are trained", file=sys.stderr, flush=True)


class ExampleBatches(TokenBatches):
    """TokenBatches whose windows are the example rows, with their labels; preference pairs are windows of two
    rows (a global batch of rows holds half as many pairs), with each row's reference log-prob."""

    def __init__(self, rows: ExampleRows, global_batch: int, dp_rank: int = 0, dp_size: int = 1, seed: int = 0,
                 split: str = "train", val_fraction: float = 0.01):
        self.row_width = w = rows.ids.shape[1]
        span = 2 if rows.pairs else 1
        if rows.pairs and global_batch % (2 * dp_size):
            raise ValueError(f"train_batch_size {global_batch} rows hold preference pairs (two rows each) split over "
                             f"{dp_size} data-parallel rank(s): make it a multiple of {2 * dp_size}")
        super().__init__(rows.ids.reshape(-1), span * w - 1, global_batch // span, dp_rank, dp_size, seed, split,
                         val_fraction)
        self.labels = np.where(rows.trained, rows.ids, IGNORE).astype(np.int64).reshape(-1)
        self.documents = rows.documents.reshape(-1) if rows.documents is not None else None
        self.ref_logps = rows.ref_logps

    def batch_at(self, position: int) -> dict[str, torch.Tensor]:
        w, span = self.row_width, (self.seq_len + 1) // self.row_width
        picked = self.window_ids(position)
        ids = torch.from_numpy(np.asarray(self.tokens.reshape(-1, span * w)[picked], dtype=np.int64)).reshape(-1, w)
        labels = torch.from_numpy(self.labels.reshape(-1, span * w)[picked]).reshape(-1, w)
        batch = {"input_ids": ids[:, :-1].contiguous(), self.target_key: labels[:, 1:].contiguous()}
        if self.ref_logps is not None:
            batch["ref_logps"] = torch.from_numpy(self.ref_logps.reshape(-1, span)[picked].reshape(-1))
        if self.documents is not None:
            docs = torch.from_numpy(np.asarray(self.documents.reshape(-1, w)[picked], dtype=np.int64))
            batch["document_ids"] = docs[:, :-1].contiguous()
        return batch
