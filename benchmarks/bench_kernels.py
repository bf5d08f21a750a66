"""The kernels the planner prices, measured on this GPU: GEMMs by shape (forward, dgrad, wgrad), causal flash
attention by sequence length and by query chunk against long keys, eager and compiled element-wise ops, and an
HBM copy. The planner's constants (bunsan/planner/constants.py) say which figures they came from.

    python benchmarks/bench_kernels.py [--out kernels.json] [--dtype bf16] [--quick]

Each figure is the median of CUDA-event-timed repeats after a warm-up. FLOPs: 2·m·k·n per GEMM; flash attention
counts the causal half (FlashAttention-2's convention: forward 4·b·heads·s²·d / 2, backward 2.5x the forward),
and a query chunk against longer keys the whole rectangle. Element-wise ops report the HBM passes over
tokens x hidden (16-bit) their seconds amount to at the measured copy bandwidth: what constants.*_PASSES price.
`--quick` runs tiny sizes on whatever device there is (a smoke test: the figures mean nothing on a CPU).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bunsan.models.llama import apply_rope  # noqa: E402
from bunsan.models.saving import rms_norm, swiglu  # noqa: E402

# (k, n) of the linear layers of 1B-70B Llamas, whole and split by tensor parallelism 2-8: q/o (h, h),
# fused qkv with GQA, gate+up (h, 2I/tp), down (I/tp, h)
GEMM_KN = [(2048, 2048), (2048, 3072), (2048, 16384), (8192, 2048), (4096, 4096), (4096, 6144), (4096, 28672),
           (14336, 4096), (4096, 7168), (3584, 4096), (8192, 8192), (8192, 10240), (8192, 57344), (28672, 8192),
           (8192, 2560), (1024, 4096), (4096, 1024)]
TOKENS = [256, 512, 1024, 2048, 4096, 8192, 16384]
SEQS = [512, 1024, 2048, 4096, 8192, 16384, 32768]


def timed(fn, device, reps: int = 10, warmup: int = 3) -> float:
    """Median seconds of `fn()`."""
    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events) / 1e3


def gemms(device, dtype, tokens, shapes) -> list[dict]:
    """A linear layer's three GEMMs per shape: forward (m,k)@(k,n), dgrad (m,n)@(n,k), wgrad (k,m)@(m,n)."""
    rows = []
    for k, n in shapes:
        w = torch.randn(k, n, device=device, dtype=dtype)
        for m in tokens:
            x = torch.randn(m, k, device=device, dtype=dtype)
            g = torch.randn(m, n, device=device, dtype=dtype)
            xt = x.t().contiguous()      # wgrad reads the input transposed: what autograd hands cuBLAS
            for kind, fn in (("forward", lambda: x @ w), ("dgrad", lambda: g @ w.t()), ("wgrad", lambda: xt @ g)):
                seconds = timed(fn, device)
                rows.append({"kind": kind, "m": m, "k": k, "n": n, "seconds": seconds,
                             "tflops": 2 * m * k * n / seconds / 1e12})
            del x, g, xt
    return rows


def flash(device, dtype, seqs, tokens_per_batch: int, heads: int, d: int) -> list[dict]:
    """Causal SDPA forward + backward at each sequence length (batch = tokens_per_batch / seq), and a query
    chunk against the longest keys (context parallelism's off-diagonal call: no mask)."""
    rows = []

    def run(q_len: int, k_len: int, batch: int, causal: bool) -> float:
        q = torch.randn(batch, heads, q_len, d, device=device, dtype=dtype, requires_grad=True)
        # K/V repeated to every query head: the form every fused kernel takes (a GQA call that one declines
        # would fall back to the math kernel, whose s x s scores at 32k tokens do not fit)
        k = torch.randn(batch, heads, k_len, d, device=device, dtype=dtype, requires_grad=True)
        v = torch.randn(batch, heads, k_len, d, device=device, dtype=dtype, requires_grad=True)
        grad = torch.randn(batch, heads, q_len, d, device=device, dtype=dtype)

        def step():
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            out.backward(grad)
        return timed(step, device, reps=5, warmup=2)

    longest = seqs[-1]
    for s in seqs:
        batch = max(1, tokens_per_batch // s)
        seconds = run(s, s, batch, causal=True)
        flops = 3.5 * 4 * batch * heads * s * s * d / 2
        rows.append({"kind": "causal", "seq": s, "batch": batch, "seconds": seconds, "tflops": flops / seconds / 1e12})
        if s < longest:
            seconds = run(s, longest, 1, causal=False)
            flops = 3.5 * 4 * heads * s * longest * d
            rows.append({"kind": "chunk", "rows": s, "keys": longest, "seconds": seconds,
                         "tflops": flops / seconds / 1e12})
    return rows


def elementwise(device, dtype, tokens: int, hidden: int, inter: int, heads: int, kv_heads: int) -> dict:
    """Seconds of bunsan's RMSNorm, SwiGLU and rotary, eager and compiled, forward alone and forward + backward
    (the backward's share is their difference, which includes ones_like's pass: one), as HBM passes over the op's
    elements (tokens x hidden; x inter for SwiGLU; x (heads + kv heads) x head_dim for rotary) at the copy's
    bandwidth."""
    d = hidden // heads
    src = torch.randn(tokens, hidden * 8, device=device, dtype=dtype)
    dst = torch.empty_like(src)
    copy_s = timed(lambda: dst.copy_(src), device)
    bandwidth = 2 * src.numel() * src.element_size() / copy_s
    del src, dst
    x = torch.randn(tokens, hidden, device=device, dtype=dtype)
    weight = torch.ones(hidden, device=device, dtype=dtype)
    gate = torch.randn(tokens, inter, device=device, dtype=dtype)
    up = torch.randn(tokens, inter, device=device, dtype=dtype)
    qk = torch.randn(1, heads + kv_heads, tokens, d, device=device, dtype=dtype)
    cos = torch.randn(tokens, d, device=device, dtype=dtype)
    sin = torch.randn(tokens, d, device=device, dtype=dtype)
    ops = {"rms_norm": (lambda f: f(x, weight, 1e-5), rms_norm, x.numel()),
           "swiglu": (lambda f: f(gate, up), swiglu, gate.numel()),
           "rope": (lambda f: f(qk, cos, sin), apply_rope, qk.numel())}
    out = {"copy_bytes_per_s": bandwidth, "tokens": tokens, "hidden": hidden}
    for name, (call, fn, elements) in ops.items():
        for mode, f in (("eager", fn), ("compiled", torch.compile(fn))):
            with torch.no_grad():
                forward = timed(lambda: call(f), device)
            for t in (x, gate, up, qk):
                t.requires_grad_(True)

            def train():
                result = call(f)
                result.backward(torch.ones_like(result))
            both = timed(train, device)
            for t in (x, gate, up, qk):
                t.requires_grad_(False).grad = None
            per_pass = elements * x.element_size() / bandwidth
            out[f"{name} {mode}"] = {"forward_s": forward, "forward_passes": forward / per_pass,
                                     "train_s": both, "backward_passes": (both - forward) / per_pass}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="kernels.json")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    ap.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test on any device")
    ap.add_argument("--parts", default="gemm,flash,elementwise")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    torch.backends.cuda.matmul.allow_tf32 = False
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "dtype": args.dtype,
              "torch": torch.__version__}
    if device.type == "cuda":
        result["power_limit_w"] = _power_limit()
    parts, quick, out = args.parts.split(","), args.quick, Path(args.out)
    if "gemm" in parts:
        big = 256 if quick else 8192
        ref = torch.randn(big, big, device=device, dtype=dtype)
        seconds = timed(lambda: ref @ ref, device)
        result["reference"] = {"m": big, "seconds": seconds, "tflops": 2 * big ** 3 / seconds / 1e12}
        del ref
        result["gemm"] = gemms(device, dtype, [64, 128] if quick else TOKENS,
                               [(128, 256), (256, 128)] if quick else GEMM_KN)
        out.write_text(json.dumps(result, indent=1))        # each part as it ends: a killed run keeps the rest
    if "flash" in parts:
        result["flash"] = flash(device, dtype, [64, 128] if quick else SEQS, 256 if quick else 16384,
                                4 if quick else 32, 32 if quick else 128)
        out.write_text(json.dumps(result, indent=1))
    if "elementwise" in parts:
        result["elementwise"] = elementwise(device, dtype, 128 if quick else 16384, 256 if quick else 4096,
                                            512 if quick else 14336, 4 if quick else 32, 2 if quick else 8)
        out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}: reference {result.get('reference', {}).get('tflops', 0):.1f} TFLOP/s")
    for row in result.get("flash", []):
        print("flash", {k: (round(v, 1) if isinstance(v, float) else v) for k, v in row.items() if k != "seconds"})
    for name, row in result.get("elementwise", {}).items():
        print(name, row)
    return 0


def _power_limit() -> float | None:
    try:
        import subprocess
        out = subprocess.run(["nvidia-smi", "--query-gpu=power.limit", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout
        return float(out.split()[0])
    except Exception:        # no nvidia-smi: the figure is recorded as unknown
        return None


if __name__ == "__main__":
    sys.exit(main())
