"""Checkpoint directories on disk: written atomically, checksummed, read without pickle.

    ROOT/latest                    the tag of the newest complete checkpoint (written last)
    ROOT/global_step120/meta.json  layout, step, config, engine and client state, every file's sha256,
                                   and the index of every piece (see pieces.py)
    ROOT/global_step120/rank00000.safetensors  what rank 0 wrote
    ROOT/global_step120/meta.sha256  meta.json's sha256, written after it (a damaged meta.json is refused)
    ROOT/.tmp-global_step130/      a save in progress (ignored by readers, removed by the next save)

Save: every rank writes its safetensors file and a JSON index into the temporary directory and
fsyncs them; rank 0 then writes meta.json, renames the directory into place, fsyncs, and only then
updates `latest` (itself written to a temporary file and renamed). A crash at any point leaves the
previous checkpoint and `latest` as they were. No write follows a symlink (a temporary name is created
exclusively, then renamed), and every name a checkpoint holds is checked before it is opened (untrusted.py).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import socket
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from bunsan.models.model_dir import what_is
from bunsan.models.tensor_file import FLOAT, TORCH_NAME, TensorFileError, checked_header
from bunsan.checkpoint.untrusted import UntrustedError, check_meta, check_pieces, inside, plain_name, read_small

FORMAT, VERSION = "bunsan-checkpoint", 2     # 2: meta.sha256 beside meta.json
META_BYTES = 1 << 30                          # a meta.json larger than this is not one bunsan wrote


class CheckpointError(RuntimeError):
    pass


def _unlink_entry(path: Path) -> None:
    """Remove what is at `path` without following it: a symlink goes, never what it points at."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)


def write_text_safely(path: Path, text: str) -> None:
    """Create `path` fresh (exclusively, never through a symlink) and write `text`, fsynced."""
    _unlink_entry(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def tag_for(step: int) -> str:
    return f"global_step{step}"


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(path: Path, obj) -> None:
    """Write, fsync, rename: a reader sees the old file or the whole new one."""
    tmp = path.with_name(path.name + ".tmp")
    write_text_safely(tmp, json.dumps(obj, indent=1))
    os.replace(tmp, path)
    _fsync(path.parent)


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def rank_file(rank: int) -> str:
    return f"rank{rank:05d}.safetensors"


def temp_dir(root: Path, tag: str) -> Path:
    return root / f".tmp-{tag}"


def begin(root: Path, tag: str) -> None:
    """Rank 0, before anyone writes: a fresh temporary directory (a crashed save's is discarded)."""
    tmp = temp_dir(root, plain_name(tag, "checkpoint tag"))
    root.mkdir(parents=True, exist_ok=True)
    _unlink_entry(tmp)
    tmp.mkdir()


def abandon(root: Path, tag: str) -> None:
    """Remove what a failed save of `tag` left: its temporary directory and temporary `latest`."""
    _unlink_entry(temp_dir(root, tag))
    if (root / "latest.tmp").is_symlink() or (root / "latest.tmp").exists():
        (root / "latest.tmp").unlink()


def write_rank(root: Path, tag: str, rank: int, tensors: dict[str, torch.Tensor], index: dict) -> None:
    """This rank's tensors and its index (pieces, scalars, checksum) into the temporary directory."""
    tmp = temp_dir(root, tag)
    if not tmp.is_dir():
        raise CheckpointError(f"rank {rank} on {socket.gethostname()} cannot see {tmp}, which rank 0 just made: "
                              f"the checkpoint directory {root} is not one filesystem shared by every node; put "
                              "checkpoint.dir on a filesystem every node mounts (NFS, Lustre, ...)")
    path = tmp / rank_file(rank)
    save_file(tensors, str(path), metadata={"format": FORMAT, "rank": str(rank)})
    os.chmod(path, 0o644)     # (safetensors writes 0600: other ranks and users read the checkpoint too)
    _fsync(path)
    index = {**index, "file": path.name, "sha256": sha256(path), "bytes": path.stat().st_size}
    write_json(tmp / f"rank{rank:05d}.json", index)


def commit(root: Path, tag: str, world: int, meta: dict, keep_last: int) -> Path:
    """Rank 0, after every rank wrote: meta.json, rename into place, then `latest`, then prune."""
    tmp = temp_dir(root, tag)
    ranks = [json.loads((tmp / f"rank{r:05d}.json").read_text()) for r in range(world)]
    meta = {**meta, "format": FORMAT, "version": VERSION, "tag": tag, "world": world,
            "files": {r["file"]: {"sha256": r["sha256"], "bytes": r["bytes"]} for r in ranks},
            "pieces": [{**p, "file": r["file"]} for r in ranks for p in r["pieces"]],
            "scalars": {k: v for r in ranks for k, v in r["scalars"].items()}}
    for r in range(world):
        (tmp / f"rank{r:05d}.json").unlink()
    write_json(tmp / "meta.json", meta)
    write_text_safely(tmp / "meta.sha256", sha256(tmp / "meta.json"))
    _fsync(tmp)
    final = root / tag
    if final.is_symlink():
        final.unlink()
    if final.exists():                       # saving the same step again: replace it, never half of it
        old = root / f".old-{tag}"
        _unlink_entry(old)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old)
    else:
        os.replace(tmp, final)
    _fsync(root)
    write_text_safely(root / "latest.tmp", tag)
    os.replace(root / "latest.tmp", root / "latest")
    _fsync(root)
    prune(root, keep_last, keep=tag)
    return final


def _step_of(meta_path: Path) -> int:
    """The step a meta.json records, or -1 when it is damaged (tried last; refused when read)."""
    try:
        if not meta_path.is_file() or meta_path.is_symlink() or meta_path.stat().st_size > META_BYTES:
            return -1
        step = json.loads(meta_path.read_text()).get("step", -1)
    except (OSError, ValueError, AttributeError, RecursionError):
        return -1
    return step if isinstance(step, int) and not isinstance(step, bool) else -1


def complete_tags(root: Path) -> list[str]:
    """Tags with a meta.json, newest step first (plain directory names only: no links, no hidden ones)."""
    if not root.is_dir():
        return []
    out = []
    for d in root.iterdir():
        meta = d / "meta.json"
        if d.is_dir() and not d.is_symlink() and not d.name.startswith(".") and meta.is_file():
            try:
                plain_name(d.name, "tag")
            except UntrustedError:
                continue
            out.append((_step_of(meta), d.name))
    return [t for _, t in sorted(out, reverse=True)]


def prune(root: Path, keep_last: int, keep: str) -> None:
    for tag in complete_tags(root)[keep_last:]:
        if tag != keep:
            shutil.rmtree(root / tag, ignore_errors=True)


def candidates(root: Path, tag: str | None) -> list[str]:
    """Tags to try, in order: the one asked for (or `latest`), then older complete ones."""
    tags = complete_tags(root)
    first = tag
    if first is None and (root / "latest").exists():
        text = read_small(root / "latest")
        first = text.strip() if text is not None else None
        try:
            plain_name(first, "`latest`")
        except UntrustedError:
            print(f"bunsan: {root / 'latest'} is not a small regular file holding a tag name; ignored (the "
                  "newest complete checkpoint is used instead)", file=sys.stderr)
            first = None
    if first is None:
        return tags
    plain_name(first, "checkpoint tag")
    return [first] + [t for t in tags if t != first]


def read_meta(root: Path, tag: str) -> dict:
    try:
        path = inside(inside(root, tag, "checkpoint tag"), "meta.json", "meta.json")
        if path.parent.is_symlink() or not path.is_file() or path.stat().st_size > META_BYTES:
            raise CheckpointError(f"{path} does not exist (or is not a regular file under {META_BYTES} bytes)")
        text = path.read_bytes()
        meta = check_meta(json.loads(text), path)
    except UntrustedError as e:
        raise CheckpointError(str(e)) from None
    except (OSError, ValueError, RecursionError) as e:
        raise CheckpointError(f"{path} is unreadable: {type(e).__name__}") from None
    if meta.get("version", 0) >= 2:     # meta.json's own checksum, written after it
        recorded = read_small(path.with_name("meta.sha256"))
        if recorded is None or recorded.strip() != hashlib.sha256(text).hexdigest():
            raise CheckpointError(f"{path} does not match meta.sha256 beside it (altered, or the save did not "
                                  "finish)")
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a bunsan checkpoint (format {meta.get('format')!r})")
    if meta.get("version", 0) > VERSION:
        raise CheckpointError(f"{path} has format version {meta['version']}; this bunsan reads up to {VERSION}")
    return meta


def _header_problem(path: Path, pieces: list[dict]) -> str | None:
    """None if every piece is a tensor of the file, of the dtype meta.json recorded (master weights floating
    point), else what is wrong: a header altered with its checksums updated reads nothing wrong."""
    try:
        header = checked_header(path)
    except TensorFileError as e:
        return str(e)
    for p in pieces:
        entry = header.get(p["key"])
        if entry is None:
            return f"{path} has no tensor {p['key']!r}, which meta.json lists; the checkpoint is damaged"
        got = TORCH_NAME.get(entry["dtype"], entry["dtype"].lower())
        if ("dtype" in p and got != p["dtype"]) or (p["kind"] == "master" and entry["dtype"] not in FLOAT):
            return (f"{path}: {p['kind']} of {p['name']!r} is stored as {got}, but was saved as "
                    f"{p.get('dtype', 'floating point')}; the file was altered (refusing to reinterpret its bytes)")
    return None


def pieces_by_file(meta: dict) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for p in meta["pieces"]:
        out.setdefault(p["file"], []).append(p)
    return out


def check_file(root: Path, tag: str, name: str, expect: dict, pieces: list[dict] | None = None) -> str | None:
    """None if the file is whole (its size and sha256, and with `pieces`, the pieces meta.json puts in it, each
    checked against the file's header), else what is wrong with it."""
    try:
        path = inside(root / tag, name, "checkpoint file")
    except UntrustedError as e:
        return str(e)
    try:
        if not os.path.lexists(path):
            return f"{path} is missing"
        kind = what_is(os.stat(path).st_mode)
        if kind is not None:      # (never opened: a pipe would block the digest forever)
            return f"{path} is {kind}, not the regular file its save wrote (replaced or altered)"
        size = path.stat().st_size
        if size != expect["bytes"]:
            return f"{path} has {size} bytes, {expect['bytes']} were written (truncated or altered)"
        if sha256(path) != expect["sha256"]:
            return f"{path} does not match its sha256 recorded in meta.json (altered or corrupted)"
        if pieces:
            return _header_problem(path, pieces)
    except OSError as e:      # (unreadable: this rank's verdict, voted with the others')
        return f"{path} cannot be read: {type(e).__name__}: {e.strerror or e}"
    return None


class Reader:
    """The pieces of one checkpoint, by (name, kind), read lazily from their files."""

    def __init__(self, root: Path, tag: str, meta: dict):
        self.dir, self.meta = root / tag, meta
        self.by_key: dict[tuple[str, str], list[dict]] = {}
        for p in meta["pieces"]:
            self.by_key.setdefault((p["name"], p["kind"]), []).append(p)
        try:
            check_pieces(self.by_key, self.dir)
        except UntrustedError as e:
            raise CheckpointError(str(e)) from None
        self._files: dict[str, object] = {}
        self.cache: dict = {}

    def alias_for(self, names: list[str]) -> None:
        """Read a checkpoint of the other naming of the same Llama weights: bunsan's Llama names
        (`layers.0...`, `lm_head.weight`) and a Hugging Face LlamaForCausalLM's (`model.layers.0...`) hold the
        same tensors (models/hf.py). Names this checkpoint lacks are looked up under the other spelling."""
        saved = {n for n, _ in self.by_key}
        for name in names:
            if name in saved:
                continue
            other = name.removeprefix("model.") if name.startswith("model.") else \
                (name if name.startswith("lm_head.") else f"model.{name}")
            if other in saved:
                for (n, kind), pieces in list(self.by_key.items()):
                    if n == other:
                        self.by_key[(name, kind)] = pieces

    def kinds_of(self, name: str) -> set[str]:
        return {k for (n, k) in self.by_key if n == name}

    def pieces(self, name: str, kind: str) -> list[dict]:
        out = self.by_key.get((name, kind))
        if not out:
            raise CheckpointError(f"checkpoint {self.dir} has no {kind} for parameter {name!r}; it was written "
                                  "for another model (or without optimizer states)")
        return out

    def read(self, piece: dict, a: int | None = None, b: int | None = None) -> torch.Tensor:
        """Elements [a, b) of a piece's stored 1-D tensor (all of it by default)."""
        f = self._files.get(piece["file"])
        if f is None:
            path = inside(self.dir, piece["file"], "checkpoint file")   # (listed and verified: check_meta)
            f = self._files[piece["file"]] = safe_open(str(path), framework="pt")
        sl = f.get_slice(piece["key"])
        # (an opaque state, 8-bit AdamW's block scales, is not one value per element: its size is its own)
        if "opaque" not in piece and math.prod(sl.get_shape()) != piece["hi"] - piece["lo"]:
            raise CheckpointError(f"{self.dir / piece['file']}: tensor {piece['key']!r} holds "
                                  f"{math.prod(sl.get_shape())} elements, its piece in meta.json says "
                                  f"{piece['hi'] - piece['lo']}; the checkpoint is damaged")
        if a is None:
            return f.get_tensor(piece["key"])
        return sl[a:b]

    def tensor(self, key: str, file: str) -> torch.Tensor | None:
        path = inside(self.dir, file, "checkpoint file")
        if file not in self.meta["files"] or not path.is_file():
            return None
        with safe_open(str(path), framework="pt") as f:
            return f.get_tensor(key) if key in f.keys() else None
