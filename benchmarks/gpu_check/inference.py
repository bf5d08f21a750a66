"""Section 6: inference on the GPU in bf16: `bunsan generate --device-map auto` and `bunsan serve` on a Hugging
Face Llama directory written from a randomly initialised bunsan Llama.

The model has the 135m preset's shape (SmolLM-135M: 30 layers, hidden 576) with a byte vocabulary, since the
directory has no tokenizer.json and bunsan then reads and writes bytes (ids 0-255). The commands run as the user
runs them (`python -m bunsan.cli ...` subprocesses); the decode rate of `generate` is timed in this process
through the same calls the command makes (bunsan.inference.load with the device map, then
bunsan.models.generate), since the command prints no rate.

A dry run: the tiny preset on the CPU, a few tokens, two concurrent requests, and the commands with dynamo off
(TORCHDYNAMO_DISABLE=1: serve compiles its KV reads where the cache is on the CPU, and inductor's seconds per
graph there would prove nothing about the check).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

from .common import REPO, Section, build_model, check, device

PROMPT = "def fibonacci(n):"
GPU_MAX_MEMORY = "0=40GiB,cpu=16GiB"       # device 0 first: --device-map auto alone places on the CPU
ROWS = ["generate --device-map auto (command)", "generate tokens/s", "serve tokens/s"]


def _sizes(dry: bool) -> dict:
    if dry:
        # two concurrent requests are the fewest that share the server's batch
        return {"preset": "tiny", "new_tokens": 4, "clients": 2, "serve_tokens": 2, "slots": 2}
    return {"preset": "135m", "new_tokens": 128, "clients": 8, "serve_tokens": 64, "slots": 8}


def _max_memory(dev) -> dict | None:
    from bunsan.cli.generate import parse_max_memory
    return parse_max_memory(GPU_MAX_MEMORY) if dev.type == "cuda" else None


def write_model(path: str, preset: str) -> dict:
    """A random bunsan Llama of the preset's shape with a byte vocabulary, as a bf16 HF directory."""
    import torch

    from bunsan.models.hf import save_llama
    model = build_model(preset, seed=0, vocab_size=256)
    save_llama(model.state_dict(), model.config, path, dtype=torch.bfloat16)
    return {"params": sum(p.numel() for p in model.parameters()), "layers": model.config.num_hidden_layers}


def _blocks_per_device(text: str) -> dict:
    """From `bunsan generate --device-map`'s memory report: {device: (blocks, measured/predicted)}."""
    out = {}
    for m in re.finditer(r"^(\S+): .*?\((\d+) blocks\); predicted.*?(?:, ([0-9.]+)x predicted)?$", text, re.M):
        out[m.group(1)] = (int(m.group(2)), float(m.group(3)) if m.group(3) else None)
    return out


def _env(dry: bool) -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(
        os.pathsep), "PYTHONUNBUFFERED": "1", **({"TORCHDYNAMO_DISABLE": "1"} if dry else {})}


def main(section: Section) -> None:
    import torch

    dry = section.dry_run
    dev = device(dry)
    sz = _sizes(dry)
    section.plan(ROWS)
    tmp = tempfile.mkdtemp(prefix="bunsan-gpu-check-hf-")
    hf_dir = os.path.join(tmp, "llama")
    shape = write_model(hf_dir, sz["preset"])
    blocks = shape["layers"] + 3               # embedding, each block, norm, head
    memory_flag = ["--max-memory", GPU_MAX_MEMORY] if dev.type == "cuda" else []
    want_device = "0" if dev.type == "cuda" else "cpu"

    def command(row):
        cmd = [sys.executable, "-m", "bunsan.cli", "generate", "--checkpoint", hf_dir, "--device-map", "auto",
               "--dtype", "bf16", "--prompt", PROMPT, "--max-new-tokens", str(sz["new_tokens"])] + memory_flag
        start = time.perf_counter()
        done = subprocess.run(cmd, cwd=REPO, env=_env(dry), capture_output=True, text=True,
                              timeout=max(5.0, section.left() - 5))
        wall = time.perf_counter() - start
        placed = _blocks_per_device(done.stdout)
        row.numbers.update(rc=done.returncode, wall_s=round(wall, 2), placement=placed, preset=sz["preset"],
                           params=shape["params"], command=" ".join(cmd[1:]))
        check(done.returncode == 0, f"rc {done.returncode}: {(done.stderr or done.stdout)[-1500:]}")
        check(PROMPT in done.stdout, f"the output does not continue the prompt: {done.stdout[:200]!r}")
        check(placed.get(want_device, (0,))[0] == blocks,
              f"expected all {blocks} blocks on {want_device}; the report says {placed}")
        ratio = placed[want_device][1]
        row.headline = (f"rc 0 in {wall:.1f} s; {blocks} blocks on {want_device}"
                        + (f", measured memory {ratio:.2f}x predicted" if ratio else ""))

    def rate(row):
        from bunsan.training.data import load_tokenizer
        from bunsan.inference import load
        from bunsan.models import generate
        tok = load_tokenizer(None)
        ids = torch.tensor([tok.encode(PROMPT)], dtype=torch.long)
        n = sz["new_tokens"]
        model, dmap = load(hf_dir, "auto", _max_memory(dev), dtype=torch.bfloat16, batch=1,
                           max_seq=ids.shape[1] + n, prompt_len=ids.shape[1])
        where_ = sorted({str(d) for d in dmap.values()})
        check(where_ == [want_device], f"blocks placed on {where_}, expected {want_device}")
        with torch.no_grad():
            generate(model, ids, 2 if dry else 8)        # warm-up: kernels, allocator
            if dev.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            out = generate(model, ids, n)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            seconds = time.perf_counter() - start
        made = out.shape[1] - ids.shape[1]
        check(made == n, f"generated {made} tokens, asked for {n}")
        row.numbers.update(tokens_per_s=round(made / seconds, 1), new_tokens=made, seconds=round(seconds, 3),
                           batch=1, dtype="bf16", placed_on=where_)
        row.headline = f"{made / seconds:,.0f} tokens/s (batch 1, greedy, {made} new tokens, bf16 on {want_device})"

    def serve(row):
        import httpx
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        log = open(os.path.join(tmp, "serve.log"), "w+")
        cmd = [sys.executable, "-m", "bunsan.cli", "serve", "--checkpoint", hf_dir, "--dtype", "bf16", "--port",
               str(port), "--device-map", "auto", "--slots", str(sz["slots"]), "--context", "256"] + memory_flag
        proc = subprocess.Popen(cmd, cwd=REPO, env=_env(dry), stdout=log, stderr=subprocess.STDOUT)
        base = f"http://127.0.0.1:{port}"

        def server_log() -> str:
            log.flush()
            log.seek(0)
            return log.read()[-1500:]
        try:
            start = time.perf_counter()
            while True:                               # up when /health answers 200
                check(proc.poll() is None, f"the server exited with rc {proc.returncode}: {server_log()}")
                check(section.left() > 5, f"no answer on /health after {time.perf_counter() - start:.0f} s: "
                                          f"{server_log()}")
                try:
                    if httpx.get(base + "/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.2)
            up_s = time.perf_counter() - start
            health = httpx.get(base + "/health", timeout=5).json()

            def ask(i: int, max_tokens: int):
                r = httpx.post(base + "/v1/completions", timeout=max(5.0, section.left() - 3),
                               json={"prompt": f"{PROMPT} # {i}", "max_tokens": max_tokens, "temperature": 0})
                check(r.status_code == 200, f"POST /v1/completions: {r.status_code} {r.text[:300]}")
                return r.json()["usage"]["completion_tokens"]
            ask(0, 4)                                 # warm-up
            n, clients = sz["serve_tokens"], sz["clients"]
            start = time.perf_counter()
            with ThreadPoolExecutor(clients) as pool:
                made = list(pool.map(lambda i: ask(i, n), range(clients)))
            seconds = time.perf_counter() - start
            check(made == [n] * clients, f"completion tokens {made}, asked for {n} each")
            row.numbers.update(tokens_per_s=round(sum(made) / seconds, 1), requests=clients, max_tokens=n,
                               seconds=round(seconds, 3), startup_s=round(up_s, 1), health=health,
                               slots=sz["slots"], command=" ".join(cmd[1:]))
            row.headline = (f"{sum(made) / seconds:,.0f} tokens/s over {clients} concurrent requests x {n} tokens "
                            f"(server up in {up_s:.1f} s)")
        finally:
            proc.send_signal(signal.SIGINT)           # uvicorn's graceful stop
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            log.close()

    try:
        section.run(ROWS[0], command, 10.0)
        section.run(ROWS[1], rate, 5.0)
        section.run(ROWS[2], serve, 10.0)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
