"""`bunsan serve` under load: requests/s and tokens/s at 1, 4 and 16 concurrent clients (continuous batching),
next to one process generating the same requests one after another (no server, no batching).

    python benchmarks/bench_serve.py [--requests 32] [--max-tokens 32] [--slots 16]

The model is a random bunsan Llama with a byte vocabulary (hidden 512, 8 layers, GQA 8/4, 23.5M parameters),
served on loopback by uvicorn in this process; clients are threads with httpx. Greedy, fp32.
"""

from __future__ import annotations

import argparse
import platform
import socket
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

SHAPE = dict(vocab_size=256, hidden_size=512, intermediate_size=1376, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=4, max_position_embeddings=512)
PROMPTS = ["def main(argv):", "import numpy as np\n", "class Config:", "for line in open(path):", "# TODO:",
           "return {", "while True:", "x = "]


def _model():
    import torch

    from bunsan.models import Llama, LlamaConfig
    torch.manual_seed(0)
    return Llama(LlamaConfig(**SHAPE)).eval()


def _serve(model, slots):
    import uvicorn

    from bunsan.training.data import load_tokenizer
    from bunsan.serve import Batcher, Limits, build_app
    batcher = Batcher(model, slots, 256)
    app = build_app(batcher, load_tokenizer(None), "bench", Limits(max_concurrent=1024))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return server, batcher, f"http://127.0.0.1:{port}/v1/completions"


def _load(url, clients, n, max_tokens):
    import httpx

    def one(i):
        t = time.perf_counter()
        r = httpx.post(url, json={"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": max_tokens,
                                  "temperature": 0}, timeout=600)
        r.raise_for_status()
        return r.json()["usage"]["completion_tokens"], time.perf_counter() - t
    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        done = list(pool.map(one, range(n)))
    wall = time.perf_counter() - start
    return n / wall, sum(k for k, _ in done) / wall, statistics.median(t for _, t in done)


def _sequential(model, n, max_tokens):
    import torch

    from bunsan.training.data import load_tokenizer
    from bunsan.models import generate
    tok = load_tokenizer(None)
    start, made = time.perf_counter(), 0
    for i in range(n):
        ids = torch.tensor([tok.encode(PROMPTS[i % len(PROMPTS)])])
        made += generate(model, ids, max_tokens).shape[1] - ids.shape[1]
    wall = time.perf_counter() - start
    return n / wall, made / wall, wall / n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--slots", type=int, default=16)
    a = ap.parse_args()
    import torch
    model = _model()
    print(f"# bench_serve {time.strftime('%Y-%m-%d %H:%M')} on {platform.node()}, {torch.get_num_threads()} threads, "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params, {a.requests} requests x "
          f"{a.max_tokens} tokens, {a.slots} slots, greedy fp32")
    _sequential(model, 2, 4)                                                    # warm-up
    rows = [("one process, requests one after another (no server)", *_sequential(model, a.requests, a.max_tokens))]
    server, batcher, url = _serve(model, a.slots)
    _load(url, 2, 2, 4)                                                         # warm-up
    for clients in (1, 4, 16):
        before = batcher.steps
        rps, tps, lat = _load(url, clients, a.requests, a.max_tokens)
        rows.append((f"bunsan serve, {clients} concurrent client(s)", rps, tps, lat,
                     f"{batcher.steps - before} decode steps"))
    server.should_exit = True
    print("| contender | requests/s | tokens/s | median latency s | note |\n|---|---|---|---|---|")
    for name, rps, tps, lat, *note in rows:
        print(f"| {name} | {rps:.2f} | {tps:.1f} | {lat:.2f} | {note[0] if note else ''} |")


if __name__ == "__main__":
    main()
