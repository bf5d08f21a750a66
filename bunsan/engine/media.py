"""A multimodal processor's batch: tensors whose first dimension is not the batch's rows, cut with their rows.

Qwen2-VL and Qwen2.5-VL processors lay every image's patches flat, one after another ([patches, dim]), with
each image's grid ([images, 3]: t, h, w; t*h*w patches) and `mm_token_type_ids` marking each row's image (1)
and video (2) tokens. An image is one run of marked tokens (the processor wraps each in vision start and end
tokens), so counting a row's runs says which images, hence which patches, are its own. A tensor of any other
first dimension than the rows has no grouping bunsan knows: it is refused by name, never cut blindly.
"""

from __future__ import annotations

import torch

# flat patches -> (their grid, the mm_token_type_ids value of their tokens)
GROUPED = {"pixel_values": ("image_grid_thw", 1), "pixel_values_videos": ("video_grid_thw", 2)}
MEDIA_KEYS = {"pixel_values", "pixel_values_videos", "image_grid_thw", "video_grid_thw", "input_features",
              "feature_attention_mask", "image_sizes", "pixel_attention_mask", "mm_token_type_ids"}


def grouped(batch) -> dict[str, str]:
    """The flat-patch keys of `batch` with their grid keys ({} for a batch without)."""
    if not isinstance(batch, dict):
        return {}
    return {k: GROUPED[k][0] for k in GROUPED if k in batch and GROUPED[k][0] in batch}


def row_keys(batch) -> list[str]:
    """The keys whose first dimension is the rows (all but the flat patches and their grids)."""
    skip = {k for pair in grouped(batch).items() for k in pair}
    return [k for k in batch if k not in skip] if isinstance(batch, dict) else []


def check_rows(batch) -> None:
    """Every tensor but the flat patches and their grids holds one entry per row of input_ids (shapes only:
    the patches' grouping is checked where they are cut, split_media)."""
    if not isinstance(batch, dict) or "input_ids" not in batch:
        return
    rows = batch["input_ids"].shape[0]
    odd = sorted(k for k in row_keys(batch) if batch[k].shape[0] != rows)
    if odd:
        shapes = ", ".join(f"{k} {list(batch[k].shape)}" for k in odd)
        raise ValueError(f"{shapes}: not one entry per row of the batch's {rows} rows. bunsan cuts micro-batches "
                         "by row and knows one other layout: flat patches with their grids (pixel_values with "
                         "image_grid_thw, and mm_token_type_ids, as Qwen2-VL's processor makes them); give one "
                         "entry per row (one image per row), or gradient_accumulation_steps 1 with one rank")


def images_per_row(batch: dict, key: str) -> torch.Tensor:
    """[rows]: how many of `key`'s images (grids) each row holds, from its runs of marked tokens."""
    grid, mark = GROUPED[key]
    if "mm_token_type_ids" not in batch:
        raise ValueError(f"{key} with {grid}: which images belong to which row is read from mm_token_type_ids, "
                         "which the batch lacks; pass the processor's mm_token_type_ids with the batch")
    marked = batch["mm_token_type_ids"] == mark
    starts = marked & ~torch.nn.functional.pad(marked[:, :-1], (1, 0))
    # the cut is made on the host, before the micro-batches go to the device (a loader's CPU tensors)
    counts = starts.sum(1).cpu()                 # host: the images per row decide the cut
    grids = batch[grid]
    patches = int(grids.prod(-1).sum())          # host: (as above)
    images = int(counts.sum())                   # host: (as above)
    if images != grids.shape[0] or patches != batch[key].shape[0]:
        raise ValueError(f"{key} {list(batch[key].shape)} with {grid} {list(grids.shape)}: the rows' "
                         f"mm_token_type_ids hold {images} runs of {mark}s (one per image), the grids "
                         f"{grids.shape[0]} images of {patches} patches in all; they must agree")
    return counts


def split_media(batch: dict, pieces: int) -> list[dict]:
    """`batch` cut along its rows into `pieces`: the per-row tensors by row, the flat patches and grids by the
    images of each piece's rows (a piece whose rows hold none gets neither key: it is text only)."""
    rows = next(batch[k].shape[0] for k in row_keys(batch))
    size = -(-rows // pieces)                    # torch.chunk's pieces: ceil(rows / pieces) rows each
    bounds = [min(size, rows - start) for start in range(0, rows, size)]
    out = [{k: c for k, c in zip(row_keys(batch), parts)}
           for parts in zip(*(batch[k].split(bounds) for k in row_keys(batch)))]
    for key, grid in grouped(batch).items():
        per_row = images_per_row(batch, key)
        images = [int(c.sum()) for c in per_row.split(bounds)]          # host: counts on the host already
        grids = batch[grid].split(images)
        patch_counts = [int(g.prod(-1).sum()) for g in grids]           # host: the grids, before the move
        for piece, g, p in zip(out, grids, batch[key].split(patch_counts)):
            if g.shape[0]:
                piece[key], piece[grid] = p, g
    return out


def refuse_media_under_cp(micro: list) -> None:
    media = sorted({k for mb in micro if isinstance(mb, dict) for k in mb} & MEDIA_KEYS)
    if media:
        raise ValueError(f"batch keys {media} under context parallelism: each rank gets a share of every row's "
                         "tokens, and an image's or a clip's features have no share to cut; train a multimodal "
                         "model without context_parallel")
