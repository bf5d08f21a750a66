"""What NCCL's point-to-point rules demand of a pipeline schedule, checked without torch.

gloo matches messages by tag and a send never waits for its receiver, so any schedule whose receives all have
sends completes there (simulation.py's "buffered" rules). NCCL is stricter:

1. it ignores tags: the k-th message from rank a to rank b lands in the k-th receive b posts from a, so the two
   ranks must list the transfers between them in the same order (`check_order`), or a message fills another's
   buffer (wrong values, or a size error);
2. a send may wait until its peer posts the matching receive, and the operations between two ranks run in
   order: a send posted on its own can block the rank until the peer gets round to receiving.

The runtime (runtime.py) therefore posts the transfers between two computes as one batch (torch.distributed.
batch_isend_irecv, as Megatron does: send-forward with receive-backward, send-backward with receive-forward)
and waits for the batch before the next compute. The first forward message of each stage in a step carries a
header (dtype and shape) that the receiver must read before it can allocate the message: a batch with such a
receive posts its sends and the headers first, then the receives.
simulation.py runs the lists under these rules: a batch completes only once every operation in it has its
counterpart posted, and a rank waits for its batch.

    rank 0:  F0 [sF0] F1 [sF1] F2 [sF2 rB0] B0 ...      ([...]: one batch)
    rank 1:  [rF0] F0 B0 [sB0 rF1] F1 B1 ...
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

KINDS = ("recv_fwd", "forward", "send_fwd", "recv_bwd", "backward", "send_bwd")
COMPUTE = ("forward", "backward")


def stage_of(a, rank: int, p: int) -> int:
    return a.chunk * p + rank


def link(a, rank: int, p: int) -> tuple:
    """(direction, micro, source stage, destination stage): identical at both ends of one transfer."""
    s = stage_of(a, rank, p)
    return {"send_fwd": ("fwd", a.micro, s, s + 1), "recv_fwd": ("fwd", a.micro, s - 1, s),
            "send_bwd": ("bwd", a.micro, s, s - 1), "recv_bwd": ("bwd", a.micro, s + 1, s)}[a.kind]


def items(acts: list) -> list:
    """A rank's list as the runtime executes it: compute actions, and batches (tuples) of the communication
    actions between two computes."""
    out, batch = [], []
    for a in acts:
        if a.kind in COMPUTE:
            if batch:
                out.append(tuple(batch))
                batch = []
            out.append(a)
        else:
            batch.append(a)
    if batch:
        out.append(tuple(batch))
    return out


def header_links(acts: list, rank: int, p: int, every: bool = False) -> set:
    """The forward receives of this rank that carry a header: the first from each source stage (in training,
    where every micro-batch has the same shape), or every one (`every`: evaluation, whose last micro-batch may
    be shorter)."""
    seen, out = set(), set()
    for a in acts:
        if a.kind == "recv_fwd":
            key = link(a, rank, p)
            if every or key[2] not in seen:
                seen.add(key[2])
                out.add(key)
    return out


def check_order(schedule: list, p: int) -> None:
    """Raise ValueError where two ranks list the transfers between them in different orders (rule 1)."""
    sent, received = defaultdict(list), defaultdict(list)
    for rank, acts in enumerate(schedule):
        for a in acts:
            if a.kind.startswith("send"):
                key = link(a, rank, p)
                sent[(rank, key[3] % p)].append((key, a))
            elif a.kind.startswith("recv"):
                key = link(a, rank, p)
                received[(key[2] % p, rank)].append((key, a))
    for pair in sorted(set(sent) | set(received)):
        s, r = sent.get(pair, []), received.get(pair, [])
        for k, ((want, a), (got, b)) in enumerate(zip(s, r)):
            if want != got:
                raise ValueError(
                    f"rank {pair[0]} sends {a.label(True)} (stage {want[2]} -> {want[3]}) as its message #{k} to "
                    f"rank {pair[1]}, which receives {b.label(True)} (stage {got[2]} -> {got[3]}) as its #{k}: NCCL "
                    "matches messages between two ranks in order, not by tag, so both must list them in the same "
                    "order")


@dataclass(frozen=True)
class Batch:
    """Operations posted together: (side, link) pairs, and the schedule's actions they carry out."""
    ops: tuple
    actions: tuple
    headers: bool = False     # also receives headers (the batch before the receives they describe)

    def describe(self) -> str:
        text = " ".join(a.label(True) for a in self.actions)
        return f"batch [{text}{' + headers' if self.headers else ''}]"


def plan(acts: list, rank: int, p: int, headed: set) -> list:
    """A rank's computes and Batches as the runtime posts them (`headed`: every link that carries a header).

    A batch with a headed receive goes in two: its sends (each with its header, if it has one) and the headers
    it receives, then, once those are read, the receives themselves."""
    out = []
    for it in items(acts):
        if not isinstance(it, tuple):
            out.append(it)
            continue
        sends, recvs, heads = [], [], []
        for a in it:
            k = link(a, rank, p)
            if a.kind.startswith("send"):
                if a.kind == "send_fwd" and k in headed:
                    sends.append(("send", ("hdr",) + k))
                sends.append(("send", k))
            else:
                if a.kind == "recv_fwd" and k in headed:
                    heads.append(("recv", ("hdr",) + k))
                recvs.append(("recv", k))
        if heads:
            out.append(Batch(tuple(sends + heads), tuple(a for a in it if a.kind.startswith("send")), True))
            out.append(Batch(tuple(recvs), tuple(a for a in it if a.kind.startswith("recv"))))
        else:
            out.append(Batch(tuple(sends + recvs), it))
    return out
