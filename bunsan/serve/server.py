"""uvicorn's server with a bounded shutdown: on SIGTERM or SIGINT (or `should_exit`), new requests get a 503,
running ones have `grace_s` seconds to finish, then every one still running is answered with an error (a 503,
or a stream's error event and [DONE]) and the process exits. uvicorn's own graceful timeout, a few seconds
later, cuts a client that does not even read its error."""

from __future__ import annotations

import os
import signal

import uvicorn

from bunsan.serve.app import Service

SEND_ERRORS_S = 5.0        # after the grace: for the errors to reach the clients
# An idle keep-alive connection is closed after this long. uvicorn's 5 s equals httpx's (so openai's) pool
# expiry: a client reusing a connection at 5 s idle races the server closing it and gets no answer. Longer
# than the clients' expiry, the client always gives up on the connection first (nginx keeps 75 s too).
KEEP_ALIVE_S = 75.0


def cpu_threads(requested: int | None = None) -> int:
    """torch's threads for a model served on the CPU: `requested`, else every core this process may use but
    one, which the event loop keeps (HTTP, tokens to text). With torch on every core the two take turns on
    them, and each small op's parallel region waits for a thread the event loop has displaced."""
    if requested is not None:
        if requested < 1:
            raise ValueError(f"--threads {requested} must be at least 1")
        return requested
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores - 1)


def bind_model_cores(threads: int) -> list[int] | None:
    """Pin this process's threads, and those they start, to the last `threads` of the cores it may use, the rest
    left to the HTTP process (started before, unpinned), as vLLM's CPU build binds its worker's OpenMP threads
    (VLLM_CPU_OMP_THREADS_BIND=auto, one core reserved): the scheduler then moves other work (the clients, a
    neighbour's job) off the model's cores rather than the model between cores. The cores bound, or None where
    none would be left for HTTP."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    allowed = sorted(os.sched_getaffinity(0))
    if threads >= len(allowed):
        return None
    cores = set(allowed[-threads:])
    for tid in os.listdir("/proc/self/task"):       # (torch's OpenMP workers too, where it started them)
        try:
            os.sched_setaffinity(int(tid), cores)
        except OSError:                             # a thread that ended meanwhile
            pass
    return sorted(cores)


class Server(uvicorn.Server):
    def __init__(self, app, host: str = "127.0.0.1", port: int = 8000, grace_s: float = 5.0,
                 log_level: str = "warning", keep_alive_s: float = KEEP_ALIVE_S, ignore_sigint: bool = False):
        """`ignore_sigint`: the HTTP process of bunsan serve's two (engine.py), whose SIGINT the model's process
        turns into one SIGTERM (uvicorn would take a second signal as a forced exit)."""
        self.service: Service = app.state.service
        self.grace_s, self.ignore_sigint = grace_s, ignore_sigint
        super().__init__(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                        timeout_graceful_shutdown=grace_s + SEND_ERRORS_S,
                                        timeout_keep_alive=keep_alive_s, backlog=4096))

    def handle_exit(self, sig, frame) -> None:
        if self.ignore_sigint and sig == signal.SIGINT:
            return
        super().handle_exit(sig, frame)

    async def shutdown(self, sockets=None) -> None:
        await self.service.drain(self.grace_s)
        await super().shutdown(sockets)
