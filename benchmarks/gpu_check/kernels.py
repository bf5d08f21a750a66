"""The last section: the kernels the planner prices (issue #41), and where compiled recompute's memory goes.

The planner prices every GEMM at one efficiency, flash attention by a curve read off FlashAttention-2's plots
and eager element-wise ops by counted HBM passes (bunsan/planner/constants.py). Here they are measured on this
GPU with benchmarks/bench_kernels.py's code: bf16 GEMMs by shape (forward, dgrad, wgrad), causal flash attention
by length and a query chunk against long keys, and bunsan's RMSNorm, SwiGLU and rotary eager and compiled as
HBM passes. Every figure goes to the row's numbers (gpu-check.json), for the constants to be fitted to. One row
times transformers' Llama-form models against bunsan's Llama of the same shape (benchmarks/bench_hf_blocks.py),
the assumption the planner prices their steps on.

The last row measures what the first H100 run left open: `train.compile` with whole-block recompute peaked at
1.31x the estimate where eager recompute was within 1%. One 1B model, bf16, per mode (eager recompute, compiled
recompute as bunsan applies it, and the compile inside the checkpoint instead): the bytes held after forward
and the step's peak. A dry run: the smallest sizes each row's logic takes, on the CPU (one shape per GEMM kind,
two lengths for flash attention's chunk rows, one step per recompute mode; torch.compile through aot_eager; no CUDA
peaks: held bytes by pack hooks only).
"""

from __future__ import annotations

import statistics

from .common import Section, check, device, free_memory, llama_config

GIB = 1024 ** 3
ROWS = ["gemm by shape", "flash attention by length", "transformers blocks", "compiled recompute memory",
        "element-wise passes", "moe block grouped_mm"]


def main(section: Section) -> None:
    section.plan(ROWS)
    dev, dry = device(section.dry_run), section.dry_run
    import torch

    import benchmarks.bench_kernels as bk
    dtype = torch.bfloat16

    def gemm(row):
        big = 64 if dry else 8192
        ref = torch.randn(big, big, device=dev, dtype=dtype)
        best = 2 * big ** 3 / bk.timed(lambda: ref @ ref, dev) / 1e12
        del ref
        rows = bk.gemms(dev, dtype, [32] if dry else bk.TOKENS, [(32, 64)] if dry else bk.GEMM_KN)
        for r in rows:
            r["of_reference"] = round(r["tflops"] / best, 4)
        row.numbers.update(reference_tflops=best, reference_n=big, gemms=rows)
        check(all(r["tflops"] > 0 for r in rows), "a GEMM timed at zero")
        fractions = sorted(r["of_reference"] for r in rows)
        long_rows = [r["of_reference"] for r in rows if r["m"] >= 4096] or fractions
        row.headline = (f"{len(rows)} GEMMs against {big}^3 at {best:.0f} TFLOP/s: median "
                        f"{statistics.median(fractions):.2f}"
                        f" of it, {min(fractions):.2f}-{max(fractions):.2f}; at >= 4096 tokens median "
                        f"{statistics.median(long_rows):.2f}")

    def flash(row):
        rows = bk.flash(dev, dtype, [16, 32] if dry else bk.SEQS, 32 if dry else 16384, 2 if dry else 32,
                        16 if dry else 128)
        row.numbers.update(flash=rows)
        causal = [r for r in rows if r["kind"] == "causal"]
        top = max(r["tflops"] for r in causal)
        row.numbers["causal_of_best"] = {r["seq"]: round(r["tflops"] / top, 3) for r in causal}
        row.headline = "causal fwd+bwd TFLOP/s by length: " + ", ".join(f"{r['seq']}: {r['tflops']:.0f}"
                                                                      for r in causal)

    def elementwise(row):
        out = bk.elementwise(dev, dtype, 16 if dry else 16384, 64 if dry else 4096, 128 if dry else 14336,
                             4 if dry else 32, 2 if dry else 8)
        row.numbers.update(out)
        row.headline = f"copy {out['copy_bytes_per_s'] / 1e9:.0f} GB/s; forward passes " + ", ".join(
            f"{k} {v['forward_passes']:.1f}" for k, v in out.items() if isinstance(v, dict))

    def transformers_blocks(row):
        # `bunsan plan` prices a Llama-form transformers model's step as bunsan's Llama of its shape: the ratio here
        # is that assumption on this GPU (benchmarks/bench_hf_blocks.py's code; one CPU thread measured it in fp32)
        import benchmarks.bench_hf_blocks as hb
        dims = dict(vocab_size=128 if dry else 32000, hidden_size=64 if dry else 2048,
                    num_hidden_layers=1 if dry else 16, num_attention_heads=4 if dry else 16,
                    num_key_value_heads=2 if dry else 8, intermediate_size=128 if dry else 5632,
                    max_position_embeddings=2048)
        ids = torch.randint(0, dims["vocab_size"], (1, 16) if dry else (4, 2048), device=dev)
        seconds = {}
        for name, build in hb.models(dims).items():
            free_memory()
            torch.manual_seed(0)
            with torch.device(dev):     # drawn where it runs (five 1B models drawn on the CPU take a while)
                model = build().to(dtype)
            seconds[name] = hb.step_seconds(model, ids, 1 if dry else 5)
            del model
        base = seconds["bunsan Llama"]
        row.numbers.update(dims=dims, tokens=list(ids.shape), step_s=seconds,
                           of_bunsan_llama={k: round(v / base, 3) for k, v in seconds.items()})
        check(len(seconds) >= 4 and all(v > 0 for v in seconds.values()), f"timed only {sorted(seconds)}")
        row.headline = "step x bunsan's Llama of the same shape: " + ", ".join(
            f"{k.removeprefix('transformers ')} {v / base:.2f}" for k, v in seconds.items() if k != "bunsan Llama")

    def recompute_memory(row):
        from torch.utils.checkpoint import checkpoint

        from bunsan.models import Llama
        from bunsan.transforms.checkpointing import apply_activation_checkpointing
        from bunsan.transforms.compile import apply_compile
        preset, mb, seq = ("tiny", 1, 16) if dry else ("1b", 4, 2048)
        shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1) if dry else {}
        results = {}
        for mode in ("eager recompute", "compiled recompute", "compile inside the checkpoint"):
            free_memory()
            torch._dynamo.reset()
            torch.manual_seed(0)
            with torch.device(dev):     # drawn where it runs (a 1B model drawn on the CPU takes seconds)
                model = Llama(llama_config(preset, **shape)).to(dtype)
            if mode == "compile inside the checkpoint":
                for block in model.layers:
                    inner = torch.compile(block.forward)
                    block.forward = lambda *a, _inner=inner, **k: checkpoint(_inner, *a, use_reentrant=False, **k)
            else:
                apply_activation_checkpointing(model)
                if mode == "compiled recompute":
                    apply_compile(model)
            ids = torch.randint(0, model.config.vocab_size, (mb, seq), device=dev)
            params = {p.untyped_storage().data_ptr() for p in model.parameters()}
            for _ in range(1 if dry else 2):        # the first step compiles (a dry run measures nothing)
                saved = {}

                def pack(t):
                    s = t.untyped_storage()
                    if s.data_ptr() not in params:
                        saved[s.data_ptr()] = s.nbytes()
                    return t
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated() if dev.type == "cuda" else 0
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    loss = model(ids).float().logsumexp(-1).mean()
                held = (torch.cuda.memory_allocated() - base) if dev.type == "cuda" else None
                loss.backward()
                peak = (torch.cuda.max_memory_allocated() - base) if dev.type == "cuda" else None
                model.zero_grad(set_to_none=True)
                del loss
            results[mode] = {"held_after_forward": held, "step_peak": peak, "saved_by_hooks": sum(saved.values())}
            del model, ids
        row.numbers.update(preset=preset, micro_batch=mb, seq=seq, torch=torch.__version__, modes=results)

        if dev.type == "cuda":
            row.headline = "held after forward / step peak GiB: " + "; ".join(
                f"{m} {r['held_after_forward'] / GIB:.2f} / {r['step_peak'] / GIB:.2f}" for m, r in results.items())
        else:                           # no allocator statistics: what autograd saved outside the checkpoints
            row.headline = "saved by hooks (MiB; no CUDA peaks on a CPU): " + "; ".join(
                f"{m} {r['saved_by_hooks'] / 2 ** 20:.2f}" for m, r in results.items())

    def moe_block(row):
        """bunsan's MoE block in bf16: torch._grouped_mm (where it runs here) against the per-expert loop on the
        same weights and tokens, outputs and gradients alike, and each kernel's tokens/s."""
        from bunsan.models.moe import MoE
        from bunsan.models.moe_config import MoEConfig
        h, width, tokens = (64, 128, 256) if dry else (2048, 1408, 16384)
        results = {}
        for kernel in ("grouped_mm", "loop"):
            cfg = MoEConfig(hidden_size=h, num_experts=8, top_k=2, expert_intermediate_size=width,
                            route_norm=True, expert_kernel="auto" if kernel == "grouped_mm" else "loop")
            torch.manual_seed(0)
            block = MoE(cfg).to(dev, dtype)
            x = torch.randn(tokens, h, generator=torch.Generator().manual_seed(1)).to(dev, dtype).requires_grad_()
            out = block(x)
            out.float().square().mean().backward()
            uses = block.experts.uses_grouped_mm(x) if kernel == "grouped_mm" else False
            results[kernel] = {"out": out.detach().float(), "grad": x.grad.detach().float().clone(),
                               "grouped_mm": uses}

            def step():
                block(x).float().square().mean().backward()
            results[kernel]["tokens_per_s"] = tokens / bk.timed(step, dev)
        a, b = results["grouped_mm"], results["loop"]
        for what in ("out", "grad"):
            err = float((a[what] - b[what]).abs().max() / b[what].abs().max().clamp(min=1e-12))
            row.numbers[f"{what}_rel_diff"] = err
            check(err < 5e-2, f"the grouped_mm kernel's {what} differs from the loop's by {err:.3g} of its largest")
        row.numbers.update(hidden=h, width=width, tokens=tokens, grouped_mm_runs=a["grouped_mm"],
                           tokens_per_s={k: round(r["tokens_per_s"]) for k, r in results.items()})
        row.headline = (f"grouped_mm {'runs' if a['grouped_mm'] else 'does not run (loop both)'}: "
                        f"{a['tokens_per_s']:,.0f} vs loop {b['tokens_per_s']:,.0f} tokens/s fwd+bwd; outputs "
                        f"within {row.numbers['out_rel_diff']:.1e}")

    # cheapest and most wanted first; a row the budget cannot hold is skipped (GPU seconds it needs: the compiles)
    need = {name: (5.0 if dry else gpu) for name, gpu in zip(ROWS, (20.0, 20.0, 30.0, 60.0, 90.0, 20.0))}
    for name, fn in zip(ROWS, (gemm, flash, transformers_blocks, recompute_memory, elementwise, moe_block)):
        section.run(name, fn, need[name])
