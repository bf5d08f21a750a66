"""Run one rank's pipeline schedule: its computes, and between each two the batch of transfers the list says.

The communication actions between two computes are posted together and the receives waited for before the
next compute (p2p_rules.py: what NCCL demands; schedules.check proves every schedule completes under it).
Sends are waited at the end of the step, or once done. Over gloo and NCCL the first forward message of each
stage in a step is preceded by a header (dtype and shape; the later ones of the step must match it, and a
gradient has the shape of the activation it belongs to), so stages need not know each other's shapes; through
the shared-memory mailbox of neighbouring ranks on one host (comm/mailbox.py) its descriptor carries them.
Every message has a tag made of (direction, sending stage, micro-batch): on gloo the messages of one step can
never be confused; NCCL ignores tags and matches in order, which the schedule checker proves consistent.
"""

from __future__ import annotations

import torch

from bunsan.comm import mailbox as shm_mailbox
from bunsan.comm.collectives import P2POp
from bunsan.pipeline.p2p_rules import items
from bunsan.pipeline.schedules import Action, check, forward_only

_HEADER = 10            # dtype code, ndim, up to 8 dims
FWD, BWD = 0, 1


class P2P:
    """Activations forward and gradients backward between the stages of one pipeline group."""

    def __init__(self, comm, group, p: int, n_stages: int, n_micro: int, device: torch.device):
        self.comm, self.group, self.p, self.n_stages, self.n_micro = comm, group, p, n_stages, n_micro
        self.device = device
        if 2 * (2 * n_stages * n_micro) + 2 >= 1 << 24:
            raise ValueError(f"{n_micro} micro-batches x {n_stages} stages exceed the pipeline's message tags; "
                             "use fewer micro-batches (gradient_accumulation_steps)")
        # Shared memory between neighbours on one host (collective: every rank builds its P2P at start-up),
        # where two steps' messages fit the descriptors; else gloo's or NCCL's point-to-point.
        fits = 4 * n_stages * n_micro <= shm_mailbox.DESCS
        self.box = comm.mailbox(group) if fits else None
        if self.box is None:
            # NCCL makes a group's communicator at its first collective, and a batch of sends and receives that
            # involves only some ranks must not be that first one (torch.distributed.batch_isend_irecv)
            comm.barrier(group)
        self.shapes: dict[int, tuple] = {}      # sending stage -> (shape, dtype) of this step's forward messages
        self.every_header = False

    def begin_step(self, every_header: bool = False) -> None:
        """Training: a header before each stage's first forward message of the step. Evaluation (every_header):
        before each message, since its last micro-batch may have fewer rows."""
        self.shapes, self.every_header = {}, every_header

    def _peer(self, stage: int) -> int:
        return self.group.ranks[stage % self.p]

    def _tag(self, direction: int, from_stage: int, micro: int) -> int:
        return 2 * ((direction * self.n_stages + from_stage) * self.n_micro + micro) + 1

    @staticmethod
    def _route(a: Action, stage: int) -> tuple[int, int, int]:
        """(direction, sending stage, receiving stage) of a transfer action run at `stage`."""
        direction, step = (FWD, 1) if a.kind.endswith("fwd") else (BWD, -1)
        return (direction, stage, stage + step) if a.kind.startswith("send") else (direction, stage - step, stage)

    def exchange(self, sends: list, recvs: list) -> tuple[list, list]:
        """One batch: `sends` [(action, stage, tensor)], `recvs` [(action, stage, like: a tensor of the shape and
        dtype to expect, or None for a forward message)]. Returns (the received tensors, in `recvs` order, and
        [(handle, tensor)] of the sends, to wait on before their tensors may go)."""
        if self.box is not None:
            return self._through_mailbox(sends, recvs)
        ops, pending = [], []
        for a, stage, t in sends:
            direction, src, dst = self._route(a, stage)
            t = t.contiguous()
            tag = self._tag(direction, src, a.micro)
            if direction == FWD:
                head = self._header_for(src, t, a)
                if head is not None:
                    ops.append(P2POp("send", head, self._peer(dst), tag))
                    pending.append(head)
            ops.append(P2POp("send", t, self._peer(dst), tag + 1))
            pending.append(t)
        heads = []
        for a, stage, like in recvs:
            direction, src, _ = self._route(a, stage)
            if direction == FWD and (self.every_header or src not in self.shapes):   # (a shape not known yet)
                head = torch.empty(_HEADER, dtype=torch.int64, device=self.device)
                ops.append(P2POp("recv", head, self._peer(src), self._tag(direction, src, a.micro)))
                heads.append((src, head))
        if heads:   # the sends and the headers first: the receives need the shapes they carry
            handles = self.comm.batch_p2p(ops, self.group)
            for (src, head), h in zip(heads, handles[len(ops) - len(heads):]):
                h.wait()
                self.shapes[src] = _read_header(head)
            sent, ops = list(zip(handles[:len(pending)], pending)), []
        else:
            sent = None
        out = []
        for a, stage, like in recvs:
            direction, src, _ = self._route(a, stage)
            shape, dtype = self.shapes[src] if direction == FWD else (like.shape, like.dtype)
            t = torch.empty(shape, dtype=dtype, device=self.device)
            ops.append(P2POp("recv", t, self._peer(src), self._tag(direction, src, a.micro) + 1))
            out.append(t)
        handles = self.comm.batch_p2p(ops, self.group) if ops else []
        if sent is None:
            sent = list(zip(handles[:len(pending)], pending))
        for h in handles[len(handles) - len(out):len(handles)]:
            h.wait()
        return out, sent

    def _header_for(self, src: int, t: torch.Tensor, a: Action) -> torch.Tensor | None:
        """The header of stage `src`'s first forward message of the step (None after it: later messages must
        have its shape, which the receiver allocates)."""
        seen = self.shapes.get(src)
        if seen is not None and not self.every_header:
            if seen != (tuple(t.shape), t.dtype):
                raise ValueError(
                    f"pipeline stage {src} sends micro-batch {a.micro} of shape {tuple(t.shape)} {t.dtype}, but its "
                    f"first message of this step had {seen[0]} {seen[1]}: the stages send the shape once per step, "
                    "so every micro-batch of a step must give the same shape (equal rows and sequence length)")
            return None
        if t.dim() > _HEADER - 2:
            raise ValueError(f"pipeline messages have at most {_HEADER - 2} dims; got shape {tuple(t.shape)}")
        self.shapes[src] = (tuple(t.shape), t.dtype)
        values = [shm_mailbox.DTYPES.index(t.dtype), t.dim(), *t.shape] + [0] * (_HEADER - 2 - t.dim())
        if self.device.type != "cuda":
            return torch.tensor(values, dtype=torch.int64, device=self.device)  # host: the device is the host
        # through pinned memory, asynchronously: torch.tensor(..., device=cuda) would wait for the stream
        pinned = torch.tensor(values, dtype=torch.int64, pin_memory=True)   # host: the header's values
        return pinned.to(self.device, non_blocking=True)

    def _through_mailbox(self, sends: list, recvs: list) -> tuple[list, list]:
        """Shared memory: a post never waits (its descriptor carries dtype and shape); a fetch blocks."""
        sent = []
        for a, stage, t in sends:
            direction, src, dst = self._route(a, stage)
            t = t.contiguous()
            sent.append((self.comm.post(self.box, t, dst % self.p, self.group, self._tag(direction, src, a.micro)), t))
        out = []
        for a, stage, _ in recvs:
            direction, src, _ = self._route(a, stage)
            out.append(self.comm.fetch(self.box, src % self.p, self.group, self._tag(direction, src, a.micro)))
        return out, sent


def _read_header(head: torch.Tensor) -> tuple[tuple, torch.dtype]:
    values = head.tolist()   # host: allocating the message needs its shape (once per stage and step)
    ndim = values[1]
    return tuple(values[2:2 + ndim]), shm_mailbox.DTYPES[values[0]]


class Runner:
    """Executes `actions` (this rank's schedule) over `micro_batches` for a StageModule."""

    def __init__(self, stage, actions: list[Action], p: int, rank: int, p2p: P2P, device, recorder=None):
        self.stage, self.p, self.rank, self.p2p, self.device = stage, p, rank, p2p, device
        self.plan = items(actions)
        self._eval_plans: dict[int, list] = {}      # micro-batches -> this rank's forward-only plan
        self.last = stage.n_stages - 1
        self.recorder = recorder

    def _stage(self, a: Action) -> int:
        return a.chunk * self.p + self.rank

    def train(self, micro_batches: list, first_input, loss_of, seq_len, after_backward=None) -> torch.Tensor:
        """Forward and backward of every micro-batch; returns the summed loss (last stage; else 0), a 1-element
        fp64 tensor on the device.

        first_input(mb) -> the first stage's input; loss_of(out, mb) -> the scalar to backpropagate
        (already divided and scaled) and the loss to report. after_backward(): after each backward piece.
        """
        received, outputs, grads, pending = {}, {}, {}, []
        total = torch.zeros(1, dtype=torch.float64, device=self.device)
        self.p2p.begin_step()
        for it in self.plan:
            if isinstance(it, tuple):
                pending = self._exchange(it, outputs, received, grads, pending)
                continue
            a = it
            s, key = self._stage(a), (a.micro, a.chunk)
            with self._record(a.kind, a.micro, a.chunk):
                if a.kind == "forward":
                    mb = micro_batches[a.micro]
                    # A received activation is a leaf that collects its gradient: the stage gets a copy, so a
                    # first layer that works in place (ReLU(inplace=True)) writes into that, not the leaf.
                    x = first_input(mb) if s == 0 else received[key].clone()
                    out = self.stage.run(a.chunk, x, seq_len(mb), mb)
                    if s == self.last:
                        out, reported = loss_of(out, mb)
                        total += reported.detach().double()
                    outputs[key] = out
                else:
                    out, grad = outputs.pop(key), None if s == self.last else grads.pop(key)
                    if out.requires_grad:   # (LoRA: a first stage with no adapters has nothing to backward)
                        torch.autograd.backward(out, grad)
                    if after_backward is not None:
                        after_backward()
        self._wait(pending)
        return total

    def _exchange(self, batch: tuple, outputs: dict, received: dict, grads: dict, pending: list,
                  record: bool = True) -> list:
        """Post one batch of transfers; file what arrived (activations to forward, gradients to backward).
        `record`: time it in the step's timeline (evaluation does not: it is not the step)."""
        sends, recvs = [], []
        for a in batch:
            s, key = self._stage(a), (a.micro, a.chunk)
            if a.kind == "send_fwd":
                sends.append((a, s, outputs[key].detach()))
            elif a.kind == "send_bwd":
                x = received.pop(key)
                sends.append((a, s, x.grad if x.grad is not None else torch.zeros_like(x)))
            elif a.kind == "recv_fwd":
                recvs.append((a, s, None))
            else:   # recv_bwd: the gradient of an output this rank sent forward
                recvs.append((a, s, outputs[key]))
        first = batch[0]
        with self._record(first.kind, first.micro, first.chunk) if record else _NULL:
            pending = self._prune(pending)
            got, sent = self.p2p.exchange(sends, recvs)
        for (a, _, _), t in zip(recvs, got):
            key = (a.micro, a.chunk)
            if a.kind == "recv_fwd":
                received[key] = t.requires_grad_(t.is_floating_point())
            else:
                grads[key] = t
        return pending + sent

    @torch.no_grad()
    def evaluate(self, micro_batches: list, first_input, loss_of, seq_len) -> torch.Tensor:
        """Forward only, micro-batch by micro-batch through every chunk (schedules.forward_only); the summed
        loss on the last stage, a 1-element fp64 tensor on the device."""
        total, pending, received, outputs = torch.zeros(1, dtype=torch.float64, device=self.device), [], {}, {}
        m, v = len(micro_batches), len(self.stage.chunk_layers)
        if m not in self._eval_plans:
            lists = forward_only(self.p, m, v)
            check(lists, self.p, m, v, forward_only=True)
            self._eval_plans[m] = items(lists[self.rank])
        self.p2p.begin_step(every_header=True)
        for it in self._eval_plans[m]:
            if isinstance(it, tuple):
                pending = self._exchange(it, outputs, received, {}, pending, record=False)
                for a in it:           # a forward's output is done with once sent
                    if a.kind == "send_fwd":
                        outputs.pop((a.micro, a.chunk))
                continue
            s, key = self._stage(it), (it.micro, it.chunk)
            mb = micro_batches[it.micro]
            x = first_input(mb) if s == 0 else received.pop(key)
            out = self.stage.run(it.chunk, x, seq_len(mb), mb)
            if s == self.last:
                total += loss_of(out, mb)[1].double()
            else:
                outputs[key] = out
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

    def _record(self, kind: str, micro: int, chunk: int):
        if self.recorder is None:
            return _NULL
        return self.recorder.record(kind, micro, chunk)


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


_NULL = _Null()
