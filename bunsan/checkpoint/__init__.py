"""Checkpoints that resume exactly and load on any layout: `engine.save_checkpoint` / `engine.load_checkpoint`.

Each rank writes only what it steps (pieces.py) as safetensors, with an index in global coordinates;
store.py makes the directory appear atomically with checksums; assemble.py reads any layout's pieces
into this layout's. Weights are saved once, as the fp32 master copy (a 16-bit model's weights are its
cast), with the optimizer states beside them; engine counters, the loss scaler and the caller's state
(data position) go to meta.json, each rank's RNG state into its own file. Nothing is pickled.
"""

from __future__ import annotations

import shutil
import socket
import sys
import warnings
from pathlib import Path

import torch
from safetensors import SafetensorError

from bunsan.checkpoint import store
from bunsan.checkpoint.assemble import read_local
from bunsan.checkpoint.pieces import frozen_of, locals_of
from bunsan.checkpoint.store import CheckpointError
from bunsan.checkpoint.untrusted import UntrustedError, plain_name
from bunsan.checkpoint.model_record import model_record
from bunsan.optim.lrs import gathered_lrs

__all__ = ["CheckpointError", "save_checkpoint", "load_checkpoint"]


def _barrier(engine) -> None:
    engine.comm.all_reduce_scalars([0.0], engine.mesh.world)


def _rank_state(engine) -> tuple[dict, dict]:
    """(tensors, index) this rank writes."""
    params, writes = locals_of(engine)
    # the strategy's group: context-parallel ranks hold what their data-parallel peers hold (an expert: the
    # ranks that hold the same experts)
    replicas = getattr(engine.strategy, "replicas", lambda i: engine.mesh.grad_group)
    replicated = engine.strategy.stage == 0     # every dp rank holds everything: they take turns by parameter
    tensors, pieces, scalars = {}, [], {}

    def take(i, lo, master, state):
        t = params[i]
        group = replicas(i)
        if not writes[i] or replicated and i % group.size != group.rank:
            return
        hi = lo + master.numel()
        for kind, value in [("master", master)] + sorted(state.items()):
            if not isinstance(value, torch.Tensor) or value.dim() == 0:
                if lo == 0:
                    v = value.item() if isinstance(value, torch.Tensor) else value
                    scalars.setdefault(t.name, {})[kind] = v if isinstance(v, int) else float(v)
                continue
            key = f"{kind}/{i}.{lo}"
            flat = value.detach().reshape(-1)
            entry = {"key": key, "kind": kind, "lo": lo, "hi": hi, "dtype": str(value.dtype).removeprefix("torch."),
                     **t.to_json()}
            if flat.numel() != hi - lo:   # not one value per element (Adafactor's factored moments, 8-bit AdamW's
                entry.update(opaque=list(value.shape))   # block scales): stored as is, read back only in place
            tensors[key] = flat.to("cpu", copy=True)
            pieces.append(entry)
    engine.strategy.visit_state(take)
    for local, lo, t, w in frozen_of(engine):
        if w:
            key = f"frozen/{local.name}" + (f".{lo}" if lo else "")
            tensors[key] = t.detach().to("cpu", copy=True)
            pieces.append({"key": key, "kind": "frozen", "lo": lo, "hi": lo + t.numel(),
                           "dtype": str(t.dtype).removeprefix("torch."), **local.to_json()})
    tensors["rng/torch"] = torch.get_rng_state()
    if engine.device.type == "cuda":
        tensors["rng/cuda"] = torch.cuda.get_rng_state(engine.device)
    return tensors, {"pieces": pieces, "scalars": scalars}


def save_checkpoint(engine, save_dir, tag: str | float | None = None, client_state: dict | None = None,
                    keep_last: int | None = None) -> Path:
    """Every rank calls it. Returns the checkpoint directory (ROOT/tag)."""
    root = Path(save_dir)
    tag = _agreed_tag(engine, store.tag_for(engine.global_step) if tag is None else tag)
    if tag == "latest":
        raise ValueError("checkpoint tag 'latest' names the pointer file; use another tag")
    plain_name(tag, "checkpoint tag")     # (every rank: the tag is agreed, so all refuse it or none)
    counters = engine.state_dict()   # (refuses a save in the middle of an optimizer step)
    counters["lrs"] = gathered_lrs(engine.optimizer, engine.base_lrs, engine.comm, engine.mesh.world)   # collective
    rank, world = engine.mesh.rank, engine.mesh.world.size
    failed = None
    if rank == 0:
        failed = _attempt(lambda: store.begin(root, tag))
    _all_or_none(engine, failed, root, tag, "creating")
    tensors, index = _rank_state(engine)
    failed = _attempt(lambda: store.write_rank(root, tag, rank, tensors, index))
    _all_or_none(engine, failed, root, tag, "writing", sum(t.numel() * t.element_size() for t in tensors.values()))
    if rank == 0:
        meta = {"step": engine.global_step, "config": engine.cfg.to_dict(),
                "layout": {"dp": engine.mesh.dp, "tp": engine.mesh.tp, "pp": engine.mesh.pp,
                           "zero": engine.strategy.stage, "dtype": str(engine.dtype).removeprefix("torch.")},
                "engine": counters, "optimizer": engine.strategy.opt_class.__name__,
                "model": model_record(engine), "client_state": client_state or {}}
        failed = _attempt(lambda: store.commit(root, tag, world, meta, keep_last or engine.cfg.checkpoint.keep_last))
    _all_or_none(engine, failed, root, tag, "committing")
    return root / tag


def _attempt(write) -> BaseException | None:
    try:
        write()
    except (OSError, SafetensorError, CheckpointError, UntrustedError) as e:   # a full disk, an unshared directory
        return e
    return None


def _all_or_none(engine, failed: BaseException | None, root: Path, tag: str, what: str, nbytes: int = 0) -> None:
    """Every rank learns whether any rank's write failed (a barrier that carries the verdict: no rank waits
    forever for one that gave up); on failure the save's temporary files go and every rank raises."""
    votes = engine.comm.all_reduce_scalars([1.0 if failed else 0.0], engine.mesh.world)
    if not votes[0]:
        return
    if engine.mesh.rank == 0:
        try:
            store.abandon(root, tag)
        except OSError:
            pass           # (what is left is a .tmp- directory, ignored by readers and removed by the next save)
    _barrier(engine)
    try:
        free = f"{shutil.disk_usage(root).free:,} bytes free there"
    except OSError:
        free = "its free space unknown"
    mine = f"this rank: {type(failed).__name__}: {failed}" if failed else "this rank's part was written"
    need = f"; this rank's share is {nbytes:,} bytes" if nbytes else ""
    raise CheckpointError(f"saving checkpoint {root / tag} failed while {what} it on {int(votes[0])} rank(s) "
                          f"({mine}{need}, {free}); the previous checkpoints are untouched and the partial "
                          "save was removed: free space or pass another checkpoint directory")


def check_shared(engine, save_dir) -> None:
    """At start-up, before hours of training: every rank sees the file rank 0 writes in `save_dir`, i.e. the
    checkpoint directory is one filesystem shared by every node (each rank writes its part into one
    directory that rank 0 then commits). Collective: every rank calls it."""
    root, rank, world = Path(save_dir), engine.mesh.rank, engine.mesh.world.size
    if world == 1:
        return
    probe = root / ".bunsan-shared-check"
    token = torch.randint(1, 2 ** 62, (1,), dtype=torch.int64) if rank == 0 else torch.zeros(1, dtype=torch.int64)
    token = token.to(engine.comm.device)
    engine.comm.broadcast(token, 0, engine.mesh.world)
    want = str(int(token.item()))
    written = None
    if rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            store.write_text_safely(probe, want)
        except OSError as e:
            written = e
    if not _everyone(engine, written is None):
        raise CheckpointError(f"checkpoint directory {root} cannot be written by rank 0"
                              f"{f' ({type(written).__name__}: {written})' if written else ''}; pass a writable "
                              "checkpoint.dir")
    try:
        seen = probe.read_text() == want
    except OSError:
        seen = False
    missing = engine.comm.all_reduce_scalars([0.0 if seen or r != rank else 1.0 for r in range(world)],
                                             engine.mesh.world)
    _barrier(engine)
    if rank == 0:
        probe.unlink(missing_ok=True)
    blind = [r for r, m in enumerate(missing) if m]
    if blind:
        raise CheckpointError(f"checkpoint directory {root} is not shared: rank(s) {blind[:8]} cannot see the file "
                              f"rank 0 wrote there (this rank is on {socket.gethostname()}); every rank writes its "
                              "part of a checkpoint into one directory, so put checkpoint.dir on a filesystem every "
                              "node mounts (NFS, Lustre, ...)")


TAG_BYTES = 255


def _agreed_tag(engine, tag) -> str:
    """The tag every rank saves under: any JSON scalar names a checkpoint (DeepSpeed's docs save with
    tag=loss.item()), and ranks that disagree use rank 0's, with a warning, as DeepSpeed does: every rank
    writes into one directory."""
    if isinstance(tag, bool) or not isinstance(tag, (str, int, float)):
        raise TypeError(f"checkpoint tag {tag!r} ({type(tag).__name__}) must be a string or a number")
    mine = str(tag)
    if engine.mesh.world.size == 1:
        return mine
    raw = mine.encode()
    codes = torch.zeros(TAG_BYTES + 1, dtype=torch.int32)
    codes[:min(len(raw), TAG_BYTES)] = torch.tensor(list(raw[:TAG_BYTES]), dtype=torch.int32)
    codes[TAG_BYTES] = int(len(raw) > TAG_BYTES)        # too long to send: every rank refuses it together
    sent = codes.to(engine.comm.device)
    engine.comm.broadcast(sent, 0, engine.mesh.world)
    got = sent.tolist()
    if got[TAG_BYTES]:
        raise ValueError(f"checkpoint tag of rank 0 is longer than {TAG_BYTES} bytes; use a shorter tag")
    agreed = bytes(c for c in got[:TAG_BYTES] if c).decode()
    if agreed != mine:
        warnings.warn(f"rank {engine.mesh.rank}: checkpoint tag {mine!r} differs from rank 0's {agreed!r}; "
                      "saving under rank 0's (pass the same tag on every rank)", stacklevel=3)
    return agreed


def _verified(engine, root: Path, tags: list[str]) -> tuple[str, dict, store.Reader]:
    """The first tag whose every file is whole (checked by all ranks together) and whose index covers every
    tensor this engine holds, with its meta and a reader of it."""
    rank, world = engine.mesh.rank, engine.mesh.world.size
    problems = []
    for tag in tags:
        reason = None
        try:
            meta = store.read_meta(root, tag)
            files = sorted(meta["files"])
            bad = [0.0] * len(files)
            in_file = store.pieces_by_file(meta)
            for k in range(rank, len(files), world):   # each rank checks its share of the files
                if store.check_file(root, tag, files[k], meta["files"][files[k]], in_file.get(files[k])):
                    bad[k] = 1.0
            bad = engine.comm.all_reduce_scalars(bad, engine.mesh.world) if bad else bad
        except CheckpointError as e:
            meta, files, bad, reason = None, [], [1.0], str(e)
        if meta is not None and any(bad):
            k = next(k for k, b in enumerate(bad) if b)
            reason = store.check_file(root, tag, files[k], meta["files"][files[k]], in_file.get(files[k])) or \
                f"{files[k]} is damaged"
        if reason is None:    # each rank checks the tensors it holds: the verdict is voted, so all act alike
            try:
                reader = _reader_for(engine, root, tag, meta)
            except CheckpointError as e:
                reader, reason = None, str(e)
            if _everyone(engine, reader is not None):
                return tag, meta, reader
            reason = reason or "another rank refused it (its message is on that rank)"
        problems.append(f"{tag}: {reason}")
        if rank == 0:
            print(f"bunsan: checkpoint {root / tag} refused: {reason}", file=sys.stderr)
    raise CheckpointError(f"no loadable checkpoint in {root}: " + ("; ".join(problems) or "none was saved"))


def _everyone(engine, ok: bool) -> bool:
    """Whether `ok` holds on every rank (a collective: every rank calls it)."""
    if engine.mesh.world.size == 1:
        return ok
    return not engine.comm.all_reduce_scalars([0.0 if ok else 1.0], engine.mesh.world)[0]


def _reader_for(engine, root: Path, tag: str, meta: dict) -> store.Reader:
    """A reader of the checkpoint that has the weights of every tensor this engine holds."""
    reader = store.Reader(root, tag, meta)
    names = [t.name for t in locals_of(engine)[0]] + [t.name for t, *_ in frozen_of(engine)]
    reader.alias_for(names)
    missing = [n for n in names if not reader.kinds_of(n) & {"master", "frozen"}]
    if missing:
        raise CheckpointError(f"checkpoint {root / tag} has no weights for {missing[:3]}"
                              f"{f' and {len(missing) - 3} more' if len(missing) > 3 else ''}; it was written for "
                              "another model, or its index was damaged")
    return reader


def load_checkpoint(engine, load_dir, tag: str | None = None, load_optimizer_states: bool = True):
    """Every rank calls it. Returns (checkpoint path, client_state), as DeepSpeed does. A damaged checkpoint
    is refused (naming the file) and the previous complete one loaded instead."""
    root = Path(load_dir)
    tags = store.candidates(root, tag)
    if not tags:
        raise CheckpointError(f"no checkpoint in {root} (no `latest` and no tag directory with a meta.json); "
                              "save one with engine.save_checkpoint or check the path")
    tag, meta, reader = _verified(engine, root, tags)
    saved_with, steps_with = meta.get("optimizer"), engine.strategy.opt_class.__name__
    if load_optimizer_states and isinstance(saved_with, str) and saved_with != steps_with:
        raise CheckpointError(f"checkpoint {root / tag} holds the states of a {saved_with} optimizer, and this "
                              f"engine steps {steps_with}: load the weights alone (load_optimizer_states=False; "
                              f"`bunsan train`: --set checkpoint.load_optimizer_states=false) or train with "
                              f"{saved_with}")
    states = _StateLoader(engine, reader, meta, load_optimizer_states)
    failed = None
    with torch.no_grad():
        try:      # (a refusal on one rank, NaN weights in its shard, say, stops every rank: voted below)
            engine.strategy.visit_state(states.put, states.create if load_optimizer_states else None)
            for local, lo, t, _ in frozen_of(engine):
                t.copy_(read_local(reader, local, "frozen", lo, lo + t.numel()))
        except CheckpointError as e:
            failed = e
        if not _everyone(engine, failed is None):
            raise failed or CheckpointError(f"checkpoint {root / tag} was refused by another rank (its message "
                                            "is on that rank)")
        engine.strategy.sync_params_from_master()     # (also drops gathered copies of ZeRO-3 units, frozen parts too)
    _restore_engine(engine, meta, reader)
    _barrier(engine)
    return root / tag, meta.get("client_state", {})


class _StateLoader:
    """Puts a checkpoint's master weights and optimizer states into the pieces this rank's strategy steps,
    whatever layout saved them (each piece is read from the saved pieces that cover it)."""

    def __init__(self, engine, reader, meta: dict, load_optimizer_states: bool):
        self.reader, self.engine = reader, engine
        self.params, _ = locals_of(engine)
        self.kinds = {t.name: sorted(reader.kinds_of(t.name) - {"master", "frozen"}) if load_optimizer_states
                      else [] for t in self.params}
        self.scalars = meta["scalars"] if load_optimizer_states else {}
        self.fused = bool(engine.strategy.opt_defaults.get("fused"))

    def covering(self, t, lo: int, hi: int) -> dict:
        """The optimizer states the checkpoint has for elements [lo, hi) of t, each with a piece that tells its
        dtype: states are per fragment (8-bit AdamW keeps fp32 states for small fragments, uint8 for large).
        A state that is not one value per element comes whole from the piece of exactly this fragment."""
        out = {}
        for k in self.kinds[t.name]:
            pieces = self.reader.pieces(t.name, k)
            here = [p for p in pieces if _same_place(p, t) and p["lo"] < hi and p["hi"] > lo]
            if "opaque" in pieces[0]:
                exact = [p for p in here if (p["lo"], p["hi"]) == (lo, hi)]
                if exact:
                    out[k] = exact[0]
                elif here or not any(_same_place(p, t) for p in pieces):
                    raise CheckpointError(
                        f"optimizer state {k!r} of {t.name!r} is not one value per element (Adafactor's factored "
                        "moments, 8-bit AdamW's block scales) and cannot be cut for another layout; load it on "
                        "the layout it was saved with, or load with load_optimizer_states=False")
            elif here or not any(_same_place(p, t) for p in pieces):
                out[k] = here[0] if here else pieces[0]
        return out

    def create(self, i, lo, hi) -> dict:
        """Factored states and block scales are put in whole, not filled: only the others are created."""
        return {k: getattr(torch, p.get("dtype", "float32")) for k, p in self.covering(self.params[i], lo, hi).items()
                if "opaque" not in p}

    def put(self, i, lo, master, state) -> None:
        t = self.params[i]
        hi = lo + master.numel()
        master.copy_(read_local(self.reader, t, "master", lo, hi))
        if not bool(torch.isfinite(master).all()):   # (else the first step's NaN loss would blame the lr)
            raise CheckpointError(f"checkpoint {self.reader.dir} holds NaN or infinite weights in {t.name!r}; it "
                                  "was saved after training diverged: load an earlier checkpoint (tag=...)")
        have = self.covering(t, lo, hi)
        for kind in have:
            if kind not in state and "opaque" not in have[kind]:
                raise CheckpointError(f"the checkpoint has optimizer state {kind!r} for {t.name!r}, which this "
                                      f"optimizer ({type(self.engine.optimizer).__name__}) does not keep; load "
                                      "with load_optimizer_states=False or use the optimizer it was saved with")
            _load_state(self.reader, t, kind, lo, hi, state, have[kind])
        for kind, value in self.scalars.get(t.name, {}).items():
            old = state.get(kind)
            if isinstance(old, torch.Tensor) or (old is None and isinstance(value, float)):
                # torch keeps `step` as an fp32 tensor, on the parameter's device only for fused optimizers
                device = old.device if old is not None else (master.device if self.fused else "cpu")
                state[kind] = torch.tensor(value, dtype=old.dtype if old is not None else torch.float32,
                                           device=device)
            else:
                state[kind] = value                    # a plain number (bitsandbytes keeps its step as an int)


def _same_place(p: dict, t) -> bool:
    """The piece was cut from a local tensor placed as t's (same tensor-parallel slice)."""
    return tuple(p["local_shape"]) == t.local_shape and p["start"] == t.start and p["tp_dim"] == t.tp_dim \
        and p.get("sections", 1) == t.sections and p.get("expert_start") == t.expert_start


def _load_state(reader, t, kind, lo, hi, state, piece: dict) -> None:
    if "opaque" in piece:     # put in whole (covering() checked it is this very fragment's)
        device = state[kind].device if isinstance(state.get(kind), torch.Tensor) else "cpu"
        state[kind] = reader.read(piece).view(piece["opaque"]).to(device)
        return
    state[kind].view(-1).copy_(read_local(reader, t, kind, lo, hi))


def _restore_engine(engine, meta: dict, reader) -> None:
    engine.load_state_dict(meta["engine"])
    if meta["world"] == engine.mesh.world.size:   # same processes: each continues its own random stream
        rng = reader.tensor("rng/torch", store.rank_file(engine.mesh.rank))
        if rng is not None:
            torch.set_rng_state(rng)
        cuda = reader.tensor("rng/cuda", store.rank_file(engine.mesh.rank))
        if cuda is not None and engine.device.type == "cuda":
            torch.cuda.set_rng_state(cuda, engine.device)
