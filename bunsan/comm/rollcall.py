"""Who did not come: a roll call through the launcher's key-value store when a collective times out.

Every rank posts the last step it finished (one store write per step). A rank whose collective times out
posts where it is waiting (op, group, the collective's number on that group), then reads the others' posts
for a short while: ranks of the group waiting in the same collective arrived; the others did not (and, if
they are waiting in another collective, that one is named). The store lives outside the process group, so
it still answers when the group is stuck; when it does not (rank 0 died), the roll call says so. Every store
call runs on a thread of its own with a deadline: a store whose host is stopped (SIGSTOP, a debugger) keeps
its connections open and never answers, and a rank must not wait on it for ever.
"""

from __future__ import annotations

import atexit
import json
import threading
import time

import torch.distributed as dist

from bunsan.comm.work import first_line


def _store():
    return dist.distributed_c10d._get_default_store()


class _StepPoster:
    """Posts the newest finished step from a thread: the training loop never waits on the store."""

    def __init__(self):
        self.latest: tuple[int, int] | None = None
        self.ready = threading.Event()
        self.stopping = False
        self.thread = threading.Thread(target=self._run, name="bunsan-step-poster", daemon=True)
        self.thread.start()
        # a daemon thread still inside a store call when the interpreter exits aborts the process from C++
        # ("terminate called without an active exception", SIGABRT) after a run that went well: stop it first
        atexit.register(self.stop)

    def post(self, rank: int, step: int) -> None:
        self.latest = (rank, step)
        self.ready.set()

    def stop(self) -> None:
        self.stopping = True
        self.ready.set()
        self.thread.join(STORE_SLACK_S)

    def _run(self) -> None:
        while True:
            self.ready.wait()
            self.ready.clear()
            if self.stopping:
                return
            rank, step = self.latest
            try:
                _store().set(f"bunsan/step/{rank}", str(step))
            except Exception:        # no store (a world of one) or it is gone: the step is still done
                pass


_poster: _StepPoster | None = None


def post_step(rank: int, step: int) -> None:
    global _poster
    if _poster is None:
        _poster = _StepPoster()
    _poster.post(rank, step)


def bounded(fn, seconds: float, what: str):
    """fn() on a thread of its own; its result, its exception, or TimeoutError after `seconds` (the thread is
    left behind, daemonic, blocked in the store)."""
    box: dict = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:      # noqa: BLE001  (handed to the caller)
            box["error"] = e
    worker = threading.Thread(target=run, name=f"bunsan-{what}", daemon=True)
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        raise TimeoutError(f"{what} got no answer within {seconds:g}s")
    if "error" in box:
        raise box["error"]
    return box["value"]


STORE_SLACK_S = 5.0      # beyond the window, for the store calls themselves


def window_for(timeout_s: float) -> float:
    """How long a rank whose collective timed out waits for its peers' posts: a bounded share of the timeout."""
    return max(2.0, min(10.0, timeout_s / 2))


def roll_call_bound(timeout_s: float) -> float:
    """The longest a roll call runs: its window and the store calls' slack."""
    return window_for(timeout_s) + STORE_SLACK_S


def _read(store, key: str):
    return store.get(key).decode() if store.check([key]) else None


def roll_call(rank: int, op: str, group, seq: int, window_s: float) -> str:
    """A sentence naming the ranks of `group` that did not reach collective number `seq` (`op`), where they
    are instead, and the last step every rank of the group finished."""
    ranks = list(group.ranks)
    if len(ranks) < 2:
        return ""
    others, seen = [r for r in ranks if r != rank], {}

    def call():
        store = _store()
        store.set(f"bunsan/at/{rank}", json.dumps({"op": op, "group": group.name, "seq": seq}))
        deadline = time.monotonic() + window_s
        while True:
            for r in others:
                if r not in seen and (posted := _read(store, f"bunsan/at/{r}")) is not None:
                    seen[r] = json.loads(posted)
            if len(seen) == len(others) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        return {r: _read(store, f"bunsan/step/{r}") for r in ranks}
    try:   # (a large world reads many keys: a little more time per rank)
        steps = bounded(call, window_s + STORE_SLACK_S + 0.01 * len(ranks), "roll call")
    except TimeoutError:
        if seen:      # the store answered, only too slowly for every key: say what it did answer
            steps = {r: None for r in ranks}
        else:
            return (f" Roll call impossible: the store on rank 0's node (rank 0's, or its agent's) did not answer "
                    f"within {window_s + STORE_SLACK_S:g}s, with its connection still open: rank 0 is stopped or "
                    "hung (SIGSTOP, a debugger, a frozen machine) rather than dead; check rank 0 and its node.")
    except Exception as e:
        first = first_line(e)      # (torch's store errors append a C++ backtrace)
        return (f" Roll call impossible ({type(e).__name__}: {first}): the store on rank 0's node (rank 0's, or its "
                "agent's) is gone, so rank 0's node probably died or was killed: check it and its log.")
    answered = dict(seen)     # (a copy: a roll call past its time may still be adding to `seen`)
    here = {"op": op, "group": group.name, "seq": seq}
    missing = [r for r in others if answered.get(r) != here]
    parts = []
    if op in ("send", "recv"):      # no common number: say where the peers are
        parts += [f"rank {r} is waiting in {w['op']} on group '{w['group']}'" for r, w in answered.items()]
        parts += [f"rank {r} did not answer within {window_s:g}s" for r in others if r not in answered]
    elif missing:
        parts.append(f"ranks {missing} did not arrive at {op} #{seq} on group '{group.name}'")
        for r in missing:
            if r in answered:
                w = answered[r]
                parts.append(f"rank {r} is waiting in {w['op']} #{w['seq']} on group '{w['group']}' instead")
            else:
                parts.append(f"rank {r} did not answer within {window_s:g}s (busy outside bunsan's collectives, "
                             "hung, or dead)")
    else:
        parts.append(f"every rank of group '{group.name}' reached {op} #{seq}; the transport failed")
    last = ", ".join(f"rank {r}: {steps[r] if steps[r] is not None else 'none'}" for r in ranks)
    parts.append(f"last step finished: {last}")
    return " Roll call: " + "; ".join(parts) + "."
