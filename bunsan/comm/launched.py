"""A rank that a launcher started (torchrun's agent, `bunsan run`, or a scheduler setting RANK and WORLD_SIZE):
it ends with its agent, and it joins the world with a roll call that names whoever does not come.

Ending with the agent: torchrun starts each worker in a session of its own, so a SIGKILLed agent (OOM
killer, a lost node manager, `kill -9`) leaves its workers running as orphans, training on with peers
whose agents wait in torch's exit barrier (300 s) for an agent that is gone. The kernel's parent-death
signal (PR_SET_PDEATHSIG) ends the worker the moment its agent dies, wherever the worker is (a watchdog
thread would need the GIL, held through long C++ calls); the peers' next collective then fails at once.

Joining: torch's env:// start-up says only "1/2 clients joined" on rank 0 and a bare connect timeout
elsewhere. Here each rank posts its host in the store before the process group forms, and a rank that
gives up after the timeout names the ranks missing and where the others are.
"""

from __future__ import annotations

import ctypes
import datetime
import os
import signal
import socket
import sys
import time

import torch.distributed as dist

from bunsan.comm.work import CommError, first_line

__all__ = ["AGENT_PID", "REACH", "agent_mark", "die_with_agent", "join_store"]

AGENT_PID = "BUNSAN_AGENT_PID"     # set by bunsan's launchers (cli/run.py, cli/launch.py): agent_mark()
PR_SET_PDEATHSIG = 1
REACH = ("resolves on every node to an address the others can reach (a hostname resolving to 127.0.1.1, "
         "Debian's default /etc/hosts, breaks gloo), that the port is open between the nodes, and that "
         "GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME name the interface between them")


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def agent_mark() -> str:
    """What an agent puts in AGENT_PID for its workers: its pid, and the PID namespace that pid means
    something in (a wrapper such as `apptainer exec --pid` gives the worker another one)."""
    return f"{os.getpid()}@{_pid_namespace()}"


def die_with_agent() -> bool:
    """Under torchrun's agent on Linux: be SIGKILLed when the agent dies. True when the bond is made.

    SIGKILL, not SIGTERM: a handler would run only once the main thread is back in Python, maybe after a
    collective's timeout. The signal comes when the *thread* that started the worker ends: torch's agent
    starts (and restarts) workers from its main thread. The worker's own children (data loader workers) watch
    their parent themselves."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:    # (a seccomp filter may refuse it)
        print(f"bunsan: prctl(PR_SET_PDEATHSIG) failed ({os.strerror(ctypes.get_errno())}): this rank will "
              "outlive its agent if the agent is killed", file=sys.stderr, flush=True)
        return False
    # The agent may have died before the bond was made. (Alive, not "our parent": a wrapper the agent ran,
    # `bunsan run --no-python sh -c ...`, is the parent then, and the bond is to it.)
    agent, _, namespace = os.environ.get(AGENT_PID, "").partition("@")
    if agent.isdigit() and namespace == _pid_namespace() and not _alive(int(agent)):
        print(f"bunsan: the agent (pid {agent}) that started this rank is gone; ending this rank",
              file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    return True


def _alive(pid: int) -> bool:
    """Running (a zombie has died: its parent has not read its status yet). Linux: /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def join_store(rank: int, world: int, timeout_s: float) -> dist.Store:
    """The store the default process group is made from (torch's env:// rules: the agent's own when it shares
    it, TORCHELASTIC_USE_AGENT_STORE, else one rank 0 hosts at MASTER_ADDR:MASTER_PORT), once all `world`
    ranks have posted themselves in it; else, after `timeout_s`, a CommError naming who is missing."""
    try:
        addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    except (KeyError, ValueError) as e:
        raise CommError(f"RANK={rank} and WORLD_SIZE={world} are set but MASTER_ADDR / MASTER_PORT are not "
                        f"({type(e).__name__}: {e}): set both to rank 0's host and a free port, or launch with "
                        "`bunsan run` / torchrun, which set them") from None
    shared = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    hosting = rank == 0 and not shared
    timeout = datetime.timedelta(seconds=timeout_s)
    where = f"{addr}:{port} (MASTER_ADDR:MASTER_PORT)"
    try:
        store = dist.TCPStore(addr, port, world, is_master=hosting, timeout=timeout, wait_for_workers=False,
                              multi_tenant=True)
    except RuntimeError as e:      # torch's DistError: the port is taken, or nobody answers there
        if hosting and any(w in str(e).lower() for w in ("address already in use", "eaddrinuse")):
            raise CommError(f"rank 0 cannot host the store on port {port} ({first_line(e)}): another process "
                            "holds the port; pick another MASTER_PORT (--master-port)") from None
        if hosting:      # (rank 0's own client connects through MASTER_ADDR too)
            raise CommError(f"rank 0 on {socket.gethostname()} hosts the store but cannot reach it at {where} "
                            f"({first_line(e)}): MASTER_ADDR must name this host; check that {addr} "
                            f"{REACH}") from None
        raise CommError(f"rank {rank} of {world} on {socket.gethostname()} could not reach "
                        f"{'the agent' if shared else 'rank 0'}'s store at {where} within {timeout_s:g}s "
                        f"(train.timeout_s; {first_line(e)}): check that rank 0's node is up and started the "
                        f"same job, and that {addr} {REACH}") from None
    # The agent's shared store outlives a round (keys of the last would mislead), and its agents have met in
    # its rendezvous: no roll call there. bunsan run and relaunch make a store per round (cli/launch.py).
    if not shared:
        _roll_call(store, rank, world, timeout_s, addr, hosting)
    return store


def _roll_call(store, rank: int, world: int, timeout_s: float, addr: str, hosting: bool) -> None:
    """Every rank posts its host and counts itself in; the verdict key ends every wait: "ok" from the last to
    come, or, once the timeout has passed, rank 0's sentence naming who is missing (the first writer wins:
    compare_set). O(world) keys, read on failure only, in a store made for this round. The other ranks wait a
    little longer than rank 0, for its verdict."""
    prefix = "bunsan/joined"
    verdict = f"{prefix}/verdict"
    grace = 0.0 if rank == 0 else min(10.0, max(2.0, timeout_s / 4))
    try:
        store.set(f"{prefix}/{rank}", socket.gethostname())
        if store.add(f"{prefix}/count", 1) == world:
            store.compare_set(verdict, "", "ok")
        try:
            store.wait([verdict], datetime.timedelta(seconds=timeout_s + grace))
        except RuntimeError:         # timed out: say who is missing (rank 0's sentence, if it wrote first);
            # the last rank may have come between its count and its "ok"
            store.compare_set(verdict, "", _missing(store, prefix, rank, world, timeout_s, addr) or "ok")
        said = store.get(verdict).decode()
    except RuntimeError as e:        # the store itself is gone: its host gave up first, or died
        raise CommError(f"rank {rank} of {world}: the store at {addr} (rank 0's, or its agent's) went away while "
                        f"the ranks were joining ({first_line(e)}): rank 0 gave up waiting (its message names "
                        "who is missing) or its node died") from None
    if said == "ok":
        return
    if hosting:        # keep the store up a moment: the ranks that came read the verdict from it
        time.sleep(min(3.0, max(0.5, timeout_s / 10)))
    raise CommError(f"rank {rank} of {world}: {said}")


def _missing(store, prefix: str, rank: int, world: int, timeout_s: float, addr: str) -> str:
    hosts = {r: store.get(f"{prefix}/{r}").decode() for r in range(world) if store.check([f"{prefix}/{r}"])}
    missing = [r for r in range(world) if r not in hosts]
    if not missing:
        return ""
    by_host: dict[str, list[int]] = {}
    for r, h in sorted(hosts.items()):
        by_host.setdefault(h, []).append(r)
    joined = "; ".join(f"ranks {_ranges(rs)} on {h}" for h, rs in by_host.items())
    per_node = os.environ.get("LOCAL_WORLD_SIZE", "")
    nodes = ""
    if per_node.isdigit() and int(per_node) > 0:     # torchrun numbers ranks node by node
        lost = sorted({r // int(per_node) for r in missing})
        nodes = f" (node(s) {_ranges(lost)}, counting from 0 at {per_node} rank(s) per node)"
    return (f"rank(s) {_ranges(missing)}{nodes} did not join within {timeout_s:g}s (train.timeout_s; seen from "
            f"rank {rank}); joined: {joined}. Check that every node started the same job with the same "
            f"WORLD_SIZE ({world}), and that {addr} (MASTER_ADDR) {REACH}")


def _ranges(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5' (and at most 8 pieces)."""
    pieces, i = [], 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        pieces.append(str(ranks[i]) if i == j else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    return ", ".join(pieces[:8]) + (", ..." if len(pieces) > 8 else "")
