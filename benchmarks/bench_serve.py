"""`bunsan serve` under load: tokens/s, time to first token and inter-token latency (p50/p99) at 1, 4, 16 and
64 concurrent clients, prefix reuse on and off, next to transformers' generation loop on the same requests
(static batches of as many requests as there are clients; its inter-token latency is a batch's decode step).

    python benchmarks/bench_serve.py [--requests-per-client 2] [--max-tokens 32] [--clients 1,4,16,64]
                                     [--load N] [--markdown benchmarks/RESULTS.md]

The model is a random bunsan Llama with a byte vocabulary (hidden 512, 8 layers, GQA 8/4, 23.5M parameters),
greedy, fp32 (`--dtype bf16`: every contender's weights and KV cache in bf16). Every prompt is a shared 256-token
prefix (a system prompt) and a distinct tail; tokens at and above 128 get a logit bias of -100, so every token is a
whole character and the first streamed chunk is the first token. `bunsan serve` runs as a user starts it, on the
model saved as a Hugging Face directory (`--slots` = the most clients, so no request waits for a slot; its HTTP
server in a process of its own, or in the model's with the one-process contender); the clients are threads of this
process, each sending its requests one after another over its own keep-alive connection (its httpx client made
before the clock starts), streamed, timing the first chunk. transformers: LlamaForCausalLM with the same weights,
`generate` on left-padded batches, the first token timed by a logits processor. vLLM's CPU build and `transformers
serve` (with and without continuous batching) run from a venv of their own (serve_peers.py). The server leaves a
core to its event loop (serve.server.cpu_threads, as `bunsan serve` does); `--load N` spins N processes beside
every contender's clients (loaded cores), spinner i pinned to the i-th core.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

SHAPE = dict(vocab_size=256, hidden_size=512, intermediate_size=1376, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=4, max_position_embeddings=512)
CONTEXT = 512
SHARED = ("You are a careful Python assistant. Answer with code only, no prose. " * 4)[:256]
TAILS = ["def main(argv):", "import numpy as np\n", "class Config:", "for line in open(path):", "# TODO:",
         "return {", "while True:", "x = "]
ASCII_ONLY = {str(i): -100.0 for i in range(128, 256)}


def _model():
    import torch

    from bunsan.models import Llama, LlamaConfig
    torch.manual_seed(0)
    return Llama(LlamaConfig(**SHAPE)).eval()


def _prompt(i: int) -> str:
    return SHARED + f"[{i}] " + TAILS[i % len(TAILS)]


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_LOCAL = threading.local()


def http():
    """This client thread's HTTP client: one keep-alive connection reused for its requests one after another,
    as a client of the openai library keeps it (every contender is measured through it)."""
    import httpx
    if getattr(_LOCAL, "client", None) is None:
        _LOCAL.client = httpx.Client(timeout=600)
    return _LOCAL.client


def _one(url: str, i: int, max_tokens: int) -> tuple[float, int, float, list[float]]:
    """(time to first token, tokens, total time, the gaps between streamed tokens) of one streamed completion."""
    body = {"prompt": _prompt(i), "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "logit_bias": ASCII_ONLY}
    start, first, tokens, arrivals = time.perf_counter(), None, 0, []
    with http().stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"] and chunk["choices"][0].get("text"):
                arrivals.append(time.perf_counter())
                if first is None:
                    first = arrivals[-1] - start
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return first, tokens, time.perf_counter() - start, [b - a for a, b in zip(arrivals, arrivals[1:])]


def wait_healthy(url: str, alive, why, timeout_s: float) -> None:
    """Until the server at `url` answers GET /health; `why()` says what went wrong if it dies or times out."""
    import httpx
    deadline = time.time() + timeout_s
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.time() < deadline and alive(), why()
        time.sleep(0.3)


def write_table(title: str, header: list[str], rows: list[list[str]], markdown: str | None, notes=()) -> None:
    """A markdown section (title, date, commit, machine, command, `notes`, the table) printed, and appended to
    `markdown` when given."""
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"## {title}", "", f"- date: {now}", f"- commit: {commit()}", f"- machine: {machine()}",
             f"- command: `python {shlex.join(sys.argv)}`", *notes, "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    print("\n".join(lines))
    if markdown:
        with open(markdown, "a") as f:
            f.write("\n".join(lines) + "\n\n")


def _clients(c: int, per_client: int, one) -> list[str]:
    """`c` client threads, each sending `per_client` requests one after another through `one(request index)`:
    [requests, tokens/s, TTFT p50, TTFT p99, ITL p50, ITL p99] as table cells; a request that got no whole
    answer (a dropped connection, an error status) is counted beside the requests, not timed."""
    failed = []

    def answered(i: int):
        try:
            return one(i)
        except Exception as e:            # noqa: BLE001  (any failure is counted, and the run goes on)
            failed.append(f"{type(e).__name__}: {e}")
            return None

    import httpx
    # Each client's httpx.Client is made before the clock starts, as an application makes its client once: making
    # one builds an SSL context, CPU work that would otherwise take the served contender's cores in the window
    ready = [httpx.Client(timeout=600) for _ in range(c)]

    def client(k: int) -> list:
        _LOCAL.client = ready[k]
        try:
            return [answered(k * per_client + j) for j in range(per_client)]
        finally:
            _LOCAL.client.close()
            _LOCAL.client = None
    with BusyCores(LOAD[0]), ThreadPoolExecutor(c) as pool:
        start = time.perf_counter()
        done = list(pool.map(client, range(c)))
        wall = time.perf_counter() - start
    if failed:
        print(f"{len(failed)} of {c * per_client} requests failed, e.g. {failed[0][:200]}", file=sys.stderr)
    runs = [x for client_runs in done for x in client_runs if x is not None]
    ttft = [t for t, _, _, _ in runs]
    gaps = [g for _, _, _, gs in runs for g in gs] or [float("nan")]
    requests = f"{len(runs)}" + (f" ({len(failed)} failed)" if failed else "")
    return [requests, f"{sum(k for _, k, _, _ in runs) / wall:.1f}", f"{_p(ttft, 0.5):.3f}",
            f"{_p(ttft, 0.99):.3f}", f"{_p(gaps, 0.5):.3f}", f"{_p(gaps, 0.99):.3f}"]


def _spin(stop, core: int) -> None:
    os.sched_setaffinity(0, {core})
    while not stop.is_set():
        pass


class BusyCores:
    """`n` processes spinning on the CPU while the clients run: the "loaded cores" case (another tenant's job),
    the same for every contender. Spinner i is pinned to the i-th core this process may use (round robin):
    left to the scheduler, where a spinner lands depends on what the server did while idle (a server whose
    worker polls a pinned core keeps both spinners off it, one that sleeps gets one on its model's core), so
    two contenders would not meet the same load."""

    def __init__(self, n: int):
        self.n, self.procs = n, []

    def __enter__(self):
        ctx = multiprocessing.get_context("spawn")
        self.stop = ctx.Event()
        cores = sorted(os.sched_getaffinity(0))
        self.procs = [ctx.Process(target=_spin, args=(self.stop, cores[i % len(cores)]), daemon=True)
                      for i in range(self.n)]
        for p in self.procs:
            p.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for p in self.procs:
            p.join(10)


def _p(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def bunsan_rows(clients: list[int], per_client: int, max_tokens: int, prefix_reuse: bool, tmp: Path,
                one_process: bool = False) -> list[list[str]]:
    """`bunsan serve` as a user starts it, on the model saved as a Hugging Face directory (byte vocabulary: its
    default tokenizer), `--slots` the most clients."""
    import httpx

    from bunsan.models.hf import save_llama
    model = _model()
    folder = tmp / "bench"
    save_llama(model.state_dict(), model.config, folder)
    port = _free_port()
    command = [sys.executable, "-m", "bunsan.cli", "serve", "--checkpoint", str(folder), "--port", str(port),
               "--slots", str(max(clients)), "--context", str(CONTEXT), "--max-tokens", str(max_tokens),
               "--shutdown-grace", "0", *(["--no-prefix-reuse"] if not prefix_reuse else []),
               *(["--one-process"] if one_process else []),
               "--dtype", DTYPE[0], *(["--threads", str(THREADS[0])] if THREADS[0] else [])]
    log = open(tmp / "serve.log", "w")
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, lambda: proc.poll() is None, lambda: (tmp / "serve.log").read_text()[-3000:], 300)
    name = "bunsan serve" + (", one process" if one_process else "")
    rows = []
    try:
        _one(url, 0, 4)                                              # warm-up
        for c in clients:
            before = _engine(url)
            figures = _clients(c, per_client, lambda i: _one(url, i, max_tokens))
            loops, busy, forward = (b - a for a, b in zip(before, _engine(url)))
            health = httpx.get(url + "/health", timeout=10).json()
            rows.append([f"{name}, prefix reuse {'on' if prefix_reuse else 'off'}", str(c), *figures,
                         f"{health.get('prefix_tokens_reused', 0)} reused so far; loop {1e3 * busy / loops:.0f} ms "
                         f"(forward {1e3 * forward / loops:.0f})"])
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
    return rows


def _engine(url: str) -> tuple[float, float, float]:
    """The server's serving loops so far, their seconds, and their forwards' seconds (its /metrics): a loop's
    mean time beside the inter-token latency the clients saw."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families
    got = {s.name: s.value for f in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text)
           for s in f.samples}
    return tuple(got[f"bunsan_engine_{k}_total"] for k in ("iterations", "busy_seconds", "forward_seconds"))


LOAD = [0]          # --load: spinning processes beside every measurement
THREADS = [None]    # --threads: bunsan serve's torch threads (None: its default)
DTYPE = ["fp32"]    # --dtype: every contender's weights and KV cache (TORCH_NAMES: torch's and the peers' name)
TORCH_NAMES = {"fp32": "float32", "bf16": "bfloat16"}


def machine() -> str:
    import torch
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        cpu = ""
    return (f"{platform.machine()} ({cpu}), {os.cpu_count()} CPUs, torch {torch.__version__}, "
            f"Python {platform.python_version()}")


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent).stdout.strip() or "not recorded"
    except OSError:
        return "not recorded"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", default="1,4,16,64", help="comma list of concurrent clients")
    p.add_argument("--requests-per-client", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--contenders", default="reuse,noreuse,transformers",
                   help="of reuse, noreuse (bunsan serve with prefix reuse on and off), one-process (bunsan serve "
                        "--one-process: HTTP on the model's process), transformers (its generate, static "
                        "batches), vllm (vLLM's CPU build), "
                        "hf-serve, hf-serve-cb (transformers serve without and with continuous batching); the last "
                        "three in a venv of their own (serve_peers.py)")
    p.add_argument("--vllm-venv", type=Path, default=Path("/tmp/bunsan-vllm-venv"),
                   help="where the peers' venv is (made when missing)")
    p.add_argument("--load", type=int, default=0, metavar="N",
                   help="N processes spinning on the CPU while the clients run, the i-th pinned to the i-th core "
                        "(loaded cores; default 0: quiet)")
    p.add_argument("--threads", type=int, default=None,
                   help="bunsan serve's torch threads (default: its own, every core but one)")
    p.add_argument("--dtype", choices=tuple(TORCH_NAMES), default="fp32",
                   help="every contender's weights and KV cache")
    p.add_argument("--rounds", type=int, default=1,
                   help="run the whole field this many times, one after another, and report medians (a shared "
                        "machine's speed drifts between contenders run minutes apart)")
    p.add_argument("--markdown", metavar="PATH", help="append a markdown section with the table to PATH")
    a = p.parse_args(argv)
    if a.rounds < 1:
        p.error(f"--rounds {a.rounds} must be at least 1")
    LOAD[0], THREADS[0], DTYPE[0] = a.load, a.threads, a.dtype
    clients = [int(c) for c in a.clients.split(",")]
    contenders = a.contenders.split(",")
    load_before = os.getloadavg()[0]
    rounds = [field(a, clients, contenders) for _ in range(a.rounds)]
    rows = rounds[0] if a.rounds == 1 else medians(rounds)
    header = ["contender", "clients", "requests", "tokens/s", "TTFT p50 s", "TTFT p99 s", "ITL p50 s", "ITL p99 s",
              "note"]
    load = (f"- {a.load} spinning processes beside the clients"
            + (", spinner i pinned to core i (loaded cores)" if a.load else " (quiet cores)")
            + f"; load average (1 min) before and after: {load_before:.1f}, {os.getloadavg()[0]:.1f}")
    notes = [load] + ([f"- {a.rounds} rounds of the whole field, one after another: each figure the median of "
                       "the rounds' (the note: every round's tokens/s)"] if a.rounds > 1 else [])
    title = f"Serving: bunsan serve vs the others ({a.max_tokens} new tokens, 256-token shared prefix, {a.dtype})"
    write_table(title, header, rows, a.markdown, notes)
    return 0


def medians(rounds: list[list[list[str]]]) -> list[list[str]]:
    """One row per contender and client count: each figure the median of the rounds', tokens/s of every round
    in the note."""
    import statistics
    out = []
    for same in zip(*rounds):
        figures = [statistics.median(float(r[k]) for r in same) for k in range(3, 8)]
        cells = [f"{figures[0]:.1f}"] + [f"{f:.3f}" for f in figures[1:]]
        requests = {r[2] for r in same}          # (a round's failed requests show here)
        out.append([*same[0][:2], " / ".join(sorted(requests)), *cells,
                    f"{same[0][8]}; rounds {' / '.join(r[3] for r in same)}"])
    return out


def field(a, clients: list[int], contenders: list[str]) -> list[list[str]]:
    """Every contender's rows, one after another."""
    rows = []
    for contender, reuse, one in (("reuse", True, False), ("noreuse", False, False), ("one-process", True, True)):
        if contender in contenders:
            with tempfile.TemporaryDirectory() as tmp:
                rows += bunsan_rows(clients, a.requests_per_client, a.max_tokens, reuse, Path(tmp), one)
    if "vllm" in contenders:
        from serve_peers import vllm_rows
        with tempfile.TemporaryDirectory() as tmp:
            rows += vllm_rows(clients, a.requests_per_client, a.max_tokens, Path(tmp), a.vllm_venv, _clients,
                              TORCH_NAMES[a.dtype])
    for contender, continuous in (("hf-serve", False), ("hf-serve-cb", True)):
        if contender in contenders:
            from serve_peers import transformers_serve_rows
            with tempfile.TemporaryDirectory() as tmp:
                rows += transformers_serve_rows(clients, a.requests_per_client, a.max_tokens, Path(tmp),
                                                a.vllm_venv, continuous, _clients, TORCH_NAMES[a.dtype])
    if "transformers" in contenders:
        with tempfile.TemporaryDirectory() as tmp:
            from serve_generate import transformers_rows
            rows += transformers_rows(clients, a.requests_per_client, a.max_tokens, Path(tmp), a.load,
                                      TORCH_NAMES[a.dtype])
    return rows


if __name__ == "__main__":
    sys.exit(main())
