"""A checkpoint directory is untrusted input (a stranger may hand one over): what it names is checked before
anything is read, and nothing outside the directory is ever read, written or echoed.

- Tags and file names are plain names inside their directory: no separators, no `..`, no leading dot, no
  symlinks (a symlink could point anywhere; its target is never opened).
- `latest` is a small regular file holding a tag; anything else is ignored with a message that does not
  repeat its content.
- `meta.json` is a JSON object whose pieces name only files listed (and so verified by sha256) in it, and
  whose pieces cover every element of every tensor exactly once: a gap would load as zeros, an overlap
  would load whichever came last.
"""

from __future__ import annotations

import math
import os
import re
import stat
from pathlib import Path

__all__ = ["UntrustedError", "plain_name", "inside", "read_small", "check_meta", "check_pieces",
           "PARAMETER_NAME"]

# A name, not a path: no separator, no "..", not hidden; any other printable character (tags such as
# "-1.5", "epoch:3" or "my run" are DeepSpeed-style and were always accepted).
PLAIN = re.compile(r"[^/\\.\x00-\x1f\x7f][^/\\\x00-\x1f\x7f]{0,199}")
PARAMETER_NAME = re.compile(r"[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*")     # dotted module path, HF's and bunsan's
SMALL = 1 << 16          # bytes: `latest`, a tag's checksum file
DTYPES = ("float32", "float16", "bfloat16", "float64", "uint8", "int8", "int16", "int32", "int64", "bool")


class UntrustedError(ValueError):
    pass


def plain_name(name, what: str) -> str:
    """`name` if it is a plain file or directory name (no path in it), else an error that does not echo it
    beyond its length (it could be anything)."""
    if not isinstance(name, str) or not PLAIN.fullmatch(name) or ".." in name:
        shown = repr(name) if isinstance(name, str) and len(name) <= 80 and name.isprintable() else \
            f"a {type(name).__name__} of length {len(name) if hasattr(name, '__len__') else '?'}"
        raise UntrustedError(f"{what} {shown} is not a plain name (no / or \\, no '..', no leading dot, no "
                             "control characters, at most 200 characters): the checkpoint is damaged or was made "
                             "to read other files")
    return name


def inside(directory: Path, name: str, what: str) -> Path:
    """directory/name for a plain `name` that is not a symlink (a missing file is the caller's to report)."""
    path = Path(directory) / plain_name(name, what)
    try:
        if stat.S_ISLNK(os.lstat(path).st_mode):
            raise UntrustedError(f"{path} is a symbolic link; a checkpoint's files must be regular files "
                                 "inside it (links are never followed)")
    except FileNotFoundError:
        pass
    return path


def read_small(path: Path, limit: int = SMALL) -> str | None:
    """The text of a small regular file that is not a symlink; None when it is missing, a link, not a regular
    file, larger than `limit` or not text (never blocks on a pipe: it is not opened unless regular)."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        data = f.read(limit + 1)
    try:
        return data.decode() if len(data) <= limit else None
    except UnicodeDecodeError:
        return None


def check_meta(meta, path: Path) -> dict:
    """The shape of a meta.json: an object with files {name: {sha256, bytes}} and a list of pieces whose file
    is one of them, whose name is a parameter name and whose ranges are non-negative integers."""
    if not isinstance(meta, dict):
        raise UntrustedError(f"{path} holds a JSON {type(meta).__name__}, not an object; the checkpoint is damaged")
    files, pieces = meta.get("files"), meta.get("pieces")
    if not isinstance(files, dict) or not isinstance(pieces, list):
        raise UntrustedError(f"{path} has no 'files' object or no 'pieces' list; the checkpoint is damaged")
    for name, info in files.items():
        plain_name(name, f"{path}: file")
        if not (isinstance(info, dict) and isinstance(info.get("sha256"), str)
                and isinstance(info.get("bytes"), int) and info["bytes"] >= 0):
            raise UntrustedError(f"{path}: file {name!r} has no sha256 and byte count; the checkpoint is damaged")
    if not isinstance(meta.get("step", 0), int) or meta.get("step", 0) < 0:
        raise UntrustedError(f"{path}: 'step' must be a non-negative integer; the checkpoint is damaged")
    for p in pieces:
        _check_piece(p, files, path)
    _check_engine(meta.get("engine"), path)
    return meta


def _check_engine(engine, path: Path) -> None:
    """The step counters and loss scaler a resume restores: numbers of the right kind (a string step would
    fail later inside the learning-rate schedule, a string scale inside the step)."""
    if engine is None:
        return
    if not isinstance(engine, dict):
        raise UntrustedError(f"{path}: 'engine' is a {type(engine).__name__}, not an object; the checkpoint is "
                             "damaged")
    for key in ("global_step", "skipped_steps"):
        if key in engine and not _count(engine[key]):
            raise UntrustedError(f"{path}: engine.{key} is {str(engine[key])[:30]!r}, not a non-negative integer; "
                                 "the checkpoint is damaged")
    scaler = engine.get("scaler")
    if scaler is None:
        return
    if not isinstance(scaler, dict):
        raise UntrustedError(f"{path}: engine.scaler is not an object; the checkpoint is damaged")
    scale = scaler.get("scale")
    if not (isinstance(scale, (int, float)) and not isinstance(scale, bool) and math.isfinite(scale) and scale > 0):
        raise UntrustedError(f"{path}: engine.scaler.scale is {str(scale)[:30]!r}, not a positive finite number; "
                             "the checkpoint is damaged")
    for key, low in (("cur_hysteresis", 0), ("iter", 0), ("skipped_steps", 0), ("last_overflow_iter", -1)):
        v = scaler.get(key)
        if v is not None and not (isinstance(v, int) and not isinstance(v, bool) and v >= low):
            raise UntrustedError(f"{path}: engine.scaler.{key} is {str(v)[:30]!r}, not an integer >= {low}; the "
                                 "checkpoint is damaged")


def _check_piece(p, files: dict, path: Path) -> None:
    if not isinstance(p, dict):
        raise UntrustedError(f"{path}: a piece is a {type(p).__name__}, not an object; the checkpoint is damaged")
    if p.get("file") not in files:
        raise UntrustedError(f"{path}: a piece of {str(p.get('name'))[:80]!r} names a file that meta.json does "
                             "not list (so it could not be verified); the checkpoint is damaged")
    name = p.get("name")
    if not isinstance(name, str) or not PARAMETER_NAME.fullmatch(name) or len(name) > 500:
        raise UntrustedError(f"{path}: a piece's name is not a parameter name (dotted letters, digits and _); "
                             "the checkpoint is damaged")
    shape, local = p.get("shape"), p.get("local_shape")
    if not isinstance(shape, list) or not isinstance(local, list) or len(shape) != len(local):
        raise UntrustedError(f"{path}: piece {name!r} has no shape and local_shape lists of one length; the "
                             "checkpoint is damaged")
    ints = [p.get("lo"), p.get("hi"), p.get("start", 0)] + shape + local
    if not all(_count(v) for v in ints) or p["lo"] > p["hi"]:
        raise UntrustedError(f"{path}: piece {name!r} has a range or shape that is not non-negative integers "
                             "with lo <= hi; the checkpoint is damaged")
    dim = p.get("tp_dim")
    if dim is not None and not (_count(dim) and dim < len(shape)):
        raise UntrustedError(f"{path}: piece {name!r} has tp_dim {str(dim)[:20]!r}, not a dimension of its shape")
    sections = p.get("sections", 1)
    if sections != 1 and not (_count(sections) and sections > 1 and dim is not None
                              and shape[dim] % sections == 0 and local[dim] % sections == 0):
        raise UntrustedError(f"{path}: piece {name!r} has sections {str(sections)[:20]!r}, not a count > 1 of "
                             "equal blocks along the dimension it is split on; the checkpoint is damaged")
    first = p.get("expert_start")
    if first is not None and not (_count(first) and dim is not None and dim >= 1 and first + local[0] <= shape[0]):
        raise UntrustedError(f"{path}: piece {name!r} has expert_start {str(first)[:20]!r}, not a run of experts "
                             "within its dim 0 beside a tensor-parallel cut along another; the checkpoint is damaged")
    if not isinstance(p.get("key"), str) or not isinstance(p.get("kind"), str):
        raise UntrustedError(f"{path}: piece {name!r} has no key or kind; the checkpoint is damaged")
    if "opaque" in p and (p["kind"] in ("master", "frozen") or not isinstance(p["opaque"], list)
                          or not all(_count(v) for v in p["opaque"])):
        raise UntrustedError(f"{path}: piece {name!r} marks a {p['kind']} as opaque (only optimizer states whose "
                             "shape is their own are); the checkpoint is damaged")
    if "dtype" in p and p["dtype"] not in DTYPES:
        raise UntrustedError(f"{path}: piece {name!r} has dtype {str(p['dtype'])[:20]!r}, not one of {DTYPES}")


def _count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def check_pieces(by_key: dict, where: Path) -> None:
    """Every (name, kind) tensor covered exactly once: within each tensor-parallel placement the [lo, hi)
    ranges tile the local tensor, and the placements tile the global tensor along their dimension."""
    for (name, kind), pieces in by_key.items():
        if any("opaque" in p for p in pieces):     # factored states: whole per fragment (assemble checks fit)
            continue
        shapes = {tuple(p["shape"]) for p in pieces}
        if len(shapes) != 1:
            raise UntrustedError(f"{where}: {kind} of {name!r} has pieces of different shapes {sorted(shapes)}; "
                                 "the checkpoint is damaged")
        placements: dict[tuple, list[tuple[int, int]]] = {}
        for p in pieces:
            key = (tuple(p["local_shape"]), p.get("tp_dim"), p.get("start", 0), p.get("sections", 1),
                   p.get("expert_start"))
            placements.setdefault(key, []).append((p["lo"], p["hi"]))
        for (local_shape, *_), ranges in placements.items():
            _tiles(sorted(ranges), math.prod(local_shape), f"{where}: {kind} of {name!r}")
        _expert_runs_tile(list(placements), shapes.pop(), f"{where}: {kind} of {name!r}")


def _expert_runs_tile(keys: list[tuple], shape: tuple, what: str) -> None:
    """The placements tile the tensor: each run of experts (expert x tensor parallelism) tiled along its
    tensor-parallel dim, and the runs along dim 0; else the tensor-parallel slices alone."""
    runs: dict = {}
    for *key, first in keys:
        runs.setdefault(first, []).append(tuple(key))
    if None in runs and len(runs) > 1:
        raise UntrustedError(f"{what}: pieces with and without a run of experts; the checkpoint is damaged")
    if None in runs:
        _placements_tile(runs[None], shape, what)
        return
    end = 0
    for first in sorted(runs):
        rows = {k[0][0] for k in runs[first]}
        if first != end or len(rows) != 1:
            raise UntrustedError(f"{what}: runs of experts do not follow each other along dim 0; the checkpoint "
                                 "is damaged")
        end = first + rows.pop()
        _placements_tile(runs[first], (end - first, *shape[1:]), what)
    if end != shape[0]:
        raise UntrustedError(f"{what}: runs of experts cover {end} of {shape[0]}; refusing it")


def _tiles(ranges: list[tuple[int, int]], total: int, what: str) -> None:
    end = 0
    for lo, hi in ranges:
        if lo != end:
            gap = "elements [{}, {}) are in no piece".format(end, lo) if lo > end else \
                f"elements from {lo} are in two pieces"
            raise UntrustedError(f"{what}: {gap}; refusing it (they would load as zeros or twice)")
        end = hi
    if end != total:
        raise UntrustedError(f"{what}: the pieces cover {end} of its {total} elements; refusing it (the rest "
                             "would load as zeros)")


def _placements_tile(keys: list[tuple], shape: tuple, what: str) -> None:
    dims = {(d, k) for _, d, _, k in keys}
    if len(dims) != 1:
        raise UntrustedError(f"{what}: pieces split along different dimensions; the checkpoint is damaged")
    dim, sections = dims.pop()
    if sections > 1:          # a fused projection's slices: each of its blocks of rows tiled alike (pieces.py)
        def block(s):
            return (*s[:dim], s[dim] // sections, *s[dim + 1:])
        shape = block(shape)
        keys = [(block(local), d, start, 1) for local, d, start, _ in keys]
    if dim is None:
        if len(keys) != 1 or keys[0][0] != shape:
            raise UntrustedError(f"{what}: whole-tensor pieces of shape {[list(k[0]) for k in keys]} for a tensor "
                                 f"of shape {list(shape)}; the checkpoint is damaged")
        return
    end = 0
    for local_shape, _, start, _ in sorted(keys, key=lambda k: k[2]):
        if start != end or len(local_shape) != len(shape) or dim >= len(shape):
            raise UntrustedError(f"{what}: tensor-parallel slices do not follow each other along dim {dim}; "
                                 "the checkpoint is damaged")
        end = start + local_shape[dim]
    if end < shape[dim]:
        raise UntrustedError(f"{what}: tensor-parallel slices cover {end} of {shape[dim]} rows; refusing it")
