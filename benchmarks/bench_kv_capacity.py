"""What a KV cache budget holds: `bunsan serve`'s paged cache against the fixed slots it replaced, on the same
mixed-length requests and the same bytes.

    python benchmarks/bench_kv_capacity.py [--budget-mib 64] [--requests 96] [--markdown benchmarks/RESULTS.md]

The model is bench_serve.py's (a random bunsan Llama, byte vocabulary, 8 layers, GQA 8/4: 16 KiB of keys and
values per token in fp32). The requests (prompts of 16 to 400 tokens, uniformly drawn, seeded;
32 new tokens each, greedy) are all submitted at once to the batcher, no HTTP, for a server context of 512
and of 2048 tokens (what each slot reserved). Rows:
- slots: what the removed design could run on this budget, budget // (context x bytes per token) sequences,
  each reserving the whole context: the same batcher, capped at that many sequences;
- paged: the batcher with sequences limited only by the blocks their real lengths fill.
Reported: the most sequences running at once, sequences held per GiB of KV at that peak, output tokens/s over
the whole run, preemptions.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serve import SHAPE, write_table  # noqa: E402


def _model(context: int):
    import torch

    from bunsan.models import Llama, LlamaConfig
    torch.manual_seed(0)
    return Llama(LlamaConfig(**{**SHAPE, "max_position_embeddings": context})).eval()


def run(model, requests: list[list[int]], slots: int, blocks: int, max_tokens: int, context: int) -> dict:
    from bunsan.serve.batcher import Batcher, Request
    batcher = Batcher(model, slots, context, num_blocks=blocks, prefix_reuse=False)
    ended, peak, tokens = [], [0], [0]

    def emit(_t):
        tokens[0] += 1
        peak[0] = max(peak[0], len(batcher.running))
    for ids in requests:
        batcher.submit(Request(ids, max_tokens, emit=emit, finish=ended.append))
    worker = threading.Thread(target=batcher.run)
    start = time.perf_counter()
    worker.start()
    while len(ended) < len(requests):
        time.sleep(0.05)
    wall = time.perf_counter() - start
    batcher.stop()
    worker.join()
    assert ended == ["length"] * len(requests), set(ended)
    return {"peak": peak[0], "tokens_per_s": tokens[0] / wall, "preempted": batcher.preempted}


def main(argv: list[str] | None = None) -> int:
    import torch

    from bunsan.serve.paged import block_bytes
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--budget-mib", type=int, default=64)
    p.add_argument("--requests", type=int, default=96)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--contexts", default="512,2048", help="the server's context (--context) per run")
    p.add_argument("--markdown", metavar="PATH")
    a = p.parse_args(argv)
    torch.set_num_threads(2)
    g = torch.Generator().manual_seed(0)
    requests = [torch.randint(0, 128, (int(torch.randint(16, 401, (1,), generator=g)),), generator=g).tolist()
                for _ in range(a.requests)]
    budget = a.budget_mib << 20
    rows = []
    for context in (int(c) for c in a.contexts.split(",")):
        model = _model(context)
        per_token = block_bytes(model.config, 1, None, torch.float32)
        blocks = budget // block_bytes(model.config, 16, None, torch.float32)
        slots = budget // (context * per_token)
        for name, cap in [(f"slots ({slots} x {context} tokens)", slots), ("paged (16-token blocks)", a.requests)]:
            r = run(model, requests, cap, blocks, a.max_tokens, context)
            rows.append([str(context), name, str(r["peak"]), f"{r['peak'] / (budget / 2**30):.0f}",
                         f"{r['tokens_per_s']:.1f}", str(r["preempted"])])
    mean = sum(len(x) for x in requests) / len(requests)
    header = ["context", "KV cache", "most sequences at once", "sequences per GiB", "output tokens/s", "preemptions"]
    write_table(f"KV cache capacity: paged vs slots ({a.budget_mib} MiB, {a.requests} requests, prompts 16-400 "
                f"tokens (mean {mean:.0f}), {a.max_tokens} new tokens)", header, rows, a.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
