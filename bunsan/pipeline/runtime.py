"""Run one rank's pipeline schedule: receive, compute, send, as the action list says.

Sends are non-blocking (their handles are waited at the end of the step), receives
block: with the schedules of schedules.py that never deadlocks (simulate() proves it
for each one). Over gloo every message is preceded by a small header (dtype and
shape), so stages need not know each other's shapes; through the shared-memory
mailbox of neighbouring ranks on one host (shm_mailbox.py) its descriptor carries
them. Every message has a tag made of (direction, sending stage, micro-batch):
messages of one step can never be confused.
"""

from __future__ import annotations

import torch

from .. import shm_mailbox
from .schedules import Action

_HEADER = 10            # dtype code, ndim, up to 8 dims
FWD, BWD = 0, 1


class P2P:
    """Activations forward and gradients backward between the stages of one pipeline group."""

    def __init__(self, comm, group, p: int, n_stages: int, n_micro: int):
        self.comm, self.group, self.p, self.n_stages, self.n_micro = comm, group, p, n_stages, n_micro
        if 2 * (2 * n_stages * n_micro) + 2 >= 1 << 24:
            raise ValueError(f"{n_micro} micro-batches x {n_stages} stages exceed the pipeline's message tags; "
                             "use fewer micro-batches (gradient_accumulation_steps)")
        # Shared memory between neighbours on one host (collective: every rank builds its P2P at start-up),
        # where two steps' messages fit the descriptors; else gloo's point-to-point.
        fits = 4 * n_stages * n_micro <= shm_mailbox.DESCS
        self.box = comm.mailbox(group) if fits else None

    def _peer(self, stage: int) -> int:
        return self.group.ranks[stage % self.p]

    def _tag(self, direction: int, from_stage: int, micro: int) -> int:
        return 2 * ((direction * self.n_stages + from_stage) * self.n_micro + micro) + 1

    def send(self, t: torch.Tensor, direction: int, from_stage: int, micro: int) -> list:
        to_stage = from_stage + 1 if direction == FWD else from_stage - 1
        t = t.contiguous()
        if t.dim() > _HEADER - 2:
            raise ValueError(f"pipeline messages have at most {_HEADER - 2} dims; got shape {tuple(t.shape)}")
        tag, peer = self._tag(direction, from_stage, micro), self._peer(to_stage)
        if self.box is not None:
            t = t.cpu()                      # the mailbox holds host memory (the group is on gloo)
            return [(self.comm.post(self.box, t, to_stage % self.p, self.group, tag), t)]
        header = torch.zeros(_HEADER, dtype=torch.int64)
        header[0], header[1] = shm_mailbox.DTYPES.index(t.dtype), t.dim()
        header[2:2 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
        return [(self.comm.isend(header, peer, self.group, tag=tag), header),
                (self.comm.isend(t, peer, self.group, tag=tag + 1), t)]

    def recv(self, direction: int, to_stage: int, micro: int, device) -> torch.Tensor:
        from_stage = to_stage - 1 if direction == FWD else to_stage + 1
        tag, peer = self._tag(direction, from_stage, micro), self._peer(from_stage)
        if self.box is not None:
            return self.comm.fetch(self.box, from_stage % self.p, self.group, tag).to(device)
        header = torch.empty(_HEADER, dtype=torch.int64)
        self.comm.irecv(header, peer, self.group, tag=tag).wait()
        ndim = int(header[1])
        out = torch.empty(header[2:2 + ndim].tolist(), dtype=shm_mailbox.DTYPES[int(header[0])], device=device)
        self.comm.irecv(out, peer, self.group, tag=tag + 1).wait()
        return out


class Runner:
    """Executes `actions` (this rank's schedule) over `micro_batches` for a StageModule."""

    def __init__(self, stage, actions: list[Action], p: int, rank: int, p2p: P2P, device, recorder=None):
        self.stage, self.actions, self.p, self.rank, self.p2p, self.device = stage, actions, p, rank, p2p, device
        self.last = stage.n_stages - 1
        self.recorder = recorder

    def _stage(self, a: Action) -> int:
        return a.chunk * self.p + self.rank

    def train(self, micro_batches: list, first_input, loss_of, seq_len) -> torch.Tensor:
        """Forward and backward of every micro-batch; returns the summed loss (last stage; else 0).

        first_input(mb) -> the first stage's input; loss_of(out, mb) -> the scalar to backpropagate
        (already divided and scaled) and the loss to report.
        """
        received, outputs, grads, pending = {}, {}, {}, []
        total = torch.zeros((), dtype=torch.float64)
        for a in self.actions:
            s, key = self._stage(a), (a.micro, a.chunk)
            with self._record(a):
                if a.kind == "recv_fwd":
                    x = self.p2p.recv(FWD, s, a.micro, self.device)
                    received[key] = x.requires_grad_(x.is_floating_point())
                elif a.kind == "forward":
                    mb = micro_batches[a.micro]
                    x = first_input(mb) if s == 0 else received[key]
                    out = self.stage.run(a.chunk, x, seq_len(mb))
                    if s == self.last:
                        out, reported = loss_of(out, mb)
                        total += reported.detach().double()
                    outputs[key] = out
                elif a.kind == "send_fwd":
                    pending = self._prune(pending)
                    pending += self.p2p.send(outputs[key].detach(), FWD, s, a.micro)
                elif a.kind == "recv_bwd":
                    grads[key] = self.p2p.recv(BWD, s, a.micro, self.device)
                elif a.kind == "backward":
                    out, grad = outputs.pop(key), None if s == self.last else grads.pop(key)
                    if out.requires_grad:   # (LoRA: a first stage with no adapters has nothing to backward)
                        torch.autograd.backward(out, grad)
                elif a.kind == "send_bwd":
                    x = received.pop(key)
                    pending += self.p2p.send(x.grad, BWD, s, a.micro)
                else:
                    raise ValueError(f"unknown pipeline action {a.kind!r}")
        self._wait(pending)
        return total

    @torch.no_grad()
    def evaluate(self, micro_batches: list, first_input, loss_of, seq_len) -> torch.Tensor:
        """Forward only, micro-batch by micro-batch through every chunk; the summed loss on the last stage."""
        total, pending = torch.zeros((), dtype=torch.float64), []
        v = len(self.stage.chunk_layers)
        for m, mb in enumerate(micro_batches):
            for c in range(v):
                s = c * self.p + self.rank
                x = first_input(mb) if s == 0 else self.p2p.recv(FWD, s, m, self.device)
                out = self.stage.run(c, x, seq_len(mb))
                if s == self.last:
                    total += loss_of(out, mb)[1].double()
                else:
                    pending += self.p2p.send(out, FWD, s, m)
        self._wait(pending)
        return total

    def _prune(self, pending: list) -> list:
        """Drop finished sends (their tensors can go); wait() on them still raises a failed one's error."""
        left = []
        for handle, tensor in pending:
            if handle.done():
                handle.wait()
            else:
                left.append((handle, tensor))
        return left

    def _wait(self, pending: list) -> None:
        for handle, _tensor in pending:   # the tensor stays referenced until its send completed
            handle.wait()

    def _record(self, a: Action):
        if self.recorder is None:
            return _NULL
        return self.recorder.record(a.kind, a.micro, a.chunk)


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


_NULL = _Null()
