"""The decode step of `bunsan serve` with the decoding rows' KV blocks read in place (serve/paged_decode.py, a
kernel torch.compile builds) against copied out for PyTorch's fused attention, on bench_serve.py's model and
prompts (a 256-byte shared prefix, cascade attention), its linear layers prepacked as the server packs them.

    python benchmarks/bench_paged_decode.py [--rows 1,8,16,32,64] [--decoded 5,130] [--steps 30] [--rounds 3]
        [--dtype fp32|bf16]

For each number of decoding rows and each length decoded so far (the rows' own blocks past the shared prefix
grow with it), the mean step time over `--steps` steps, the median of `--rounds` rounds, alternating the two
reads on one thread (the server gives its model one). "auto" is what the server runs: in place from
paged_decode.MIN_BYTES of keys and values a layer, copies below it.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench_serve import _model, _prompt


def step_ms(model, rows: int, decoded: int, steps: int, reads: str) -> float:
    import bunsan.serve.paged_decode as paged_decode
    from bunsan.serve.batcher import Batcher
    from bunsan.serve.paged_decode import in_place
    from bunsan.serve.sequence import Request
    paged_decode.in_place = {"copies": lambda *a: False, "in place": lambda q, pool, table=None: in_place(q, pool),
                             "auto": in_place}[reads]
    try:
        batcher = Batcher(model, slots=max(rows, 2), max_len=512)
        batcher.cache.warm(model.config.num_attention_heads // model.config.num_key_value_heads)
        for i in range(rows):
            batcher.submit(Request(list(_prompt(i).encode()), decoded + steps + 8, emit=lambda t: None,
                                   finish=lambda reason: None))
        while batcher.waiting or batcher.prefilling:
            batcher._iterate()
        for _ in range(decoded):
            batcher._iterate()
        start = time.perf_counter()
        for _ in range(steps):
            batcher._iterate()
        return (time.perf_counter() - start) / steps * 1e3
    finally:
        paged_decode.in_place = in_place


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,8,16,32,64")
    p.add_argument("--decoded", default="5,130", help="tokens each row decoded before the timed steps")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="the weights' and KV cache's")
    a = p.parse_args()
    from bunsan.serve.cpu_linear import pack_linears
    torch.set_num_threads(1)
    model = _model().to({"fp32": torch.float32, "bf16": torch.bfloat16}[a.dtype])
    pack_linears(model, rows=64)
    print("| rows | decoded | copies ms | in place ms | in place / copies | auto ms |")
    print("|---|---|---|---|---|---|")
    for decoded in map(int, a.decoded.split(",")):
        for rows in map(int, a.rows.split(",")):
            got = {reads: [] for reads in ("copies", "in place", "auto")}
            for _ in range(a.rounds):
                for reads in got:
                    got[reads].append(step_ms(model, rows, decoded, a.steps, reads))
            copies, placed, auto = (statistics.median(got[r]) for r in ("copies", "in place", "auto"))
            print(f"| {rows} | {decoded} | {copies:.1f} | {placed:.1f} | {placed / copies:.2f} | {auto:.1f} |",
                  flush=True)


if __name__ == "__main__":
    main()
