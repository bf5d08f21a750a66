"""Sections 4 and 5: throughput and memory of the 1B preset (Llama-3.2-1B's shape, vocabulary 128256), bf16,
sequence 2048, on one GPU: bunsan eager and compiled (`train.compile`), activation checkpointing off and on,
each at the largest micro-batch that fits, next to torch's own plain loop on the same model and batch; then
each bunsan run's measured peak memory against `bunsan estimate` for its layout.

torch's loop is torch.autocast(bf16) over the fp32 model with torch.optim.AdamW (its defaults): fp32 master
weights and fp32 Adam states, bf16 matrix products, as bunsan's bf16 keeps (bunsan holds a bf16 copy of the
weights beside its fp32 master; autocast casts the fp32 weights at each use instead), and the loss
F.cross_entropy(logits.float()) that most loops write. MFU = tokens/s x (6N + 12 L h s) / the GPU's dense bf16
peak (bunsan.metrics.PEAK_BF16_FLOPS, NVIDIA's datasheet); an 8192^3 bf16 matrix product gives the measured
ceiling beside it. The issue's targets (>= 45% MFU compiled; bunsan >= torch's loop) are reported as met or
not; a row fails only if its steps error. A dry run: a two-layer tiny model, sequence 16, one timed step, compile
off (its rows run eager), no MFU (a CPU has no known peak), memory against the CPU-side estimate, and a
simulated out-of-memory at the first micro-batch so that the search's retry path runs too.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from .common import RowFailed, Section, check, device, free_memory, llama_config

MFU_TARGET = 0.45
MEMORY_TOLERANCE = 0.10


@dataclass
class Plan:
    preset: str
    seq: int
    micro_batches: tuple       # the search's candidates, largest first
    warmup: int
    timed: int
    compile: bool
    matmul: int                # n of the n x n x n reference product
    model: dict = field(default_factory=dict)    # the preset's fields changed


GPU_PLAN = Plan("1b", 2048, (16, 8, 4, 2, 1), warmup=2, timed=5, compile=True, matmul=8192)
DRY_PLAN = Plan("tiny", 16, (2, 1), warmup=1, timed=1, compile=False, matmul=128,
                model=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2))
DRY_SIMULATED_OOM_ABOVE = 1    # dry run, first bunsan run: micro-batches above this "run out of memory"

# runs: (row, who, compile, checkpointing, seconds it needs on the GPU: a compile takes most of it)
RUNS = [
    ("bunsan eager", "bunsan", False, False, 35),
    ("bunsan eager checkpointing", "bunsan", False, True, 30),
    ("torch eager (autocast)", "torch", False, False, 30),
    ("bunsan compiled", "bunsan", True, False, 100),
    ("torch compiled (autocast)", "torch", True, False, 90),
    ("bunsan compiled checkpointing", "bunsan", True, True, 100),
]
MATMUL_ROW = "matmul reference rate"


def memory_row(name: str) -> str:
    return "memory " + name


@dataclass
class Result:
    micro_batch: int
    tokens_per_s: float
    step_s: float
    first_step_s: float
    losses: list
    tried: list = field(default_factory=list)        # (micro-batch, why it did not fit)
    peak_allocated: int | None = None
    peak_reserved: int | None = None
    report: dict = field(default_factory=dict)       # engine.memory_report() after the last step (bunsan)
    peak_rss: int | None = None
    compile_stats: dict = field(default_factory=dict)
    config: dict = field(default_factory=dict)


def _is_oom(e: BaseException) -> bool:
    from bunsan.doctor.oom import OutOfMemory, is_oom
    return isinstance(e, OutOfMemory) or is_oom(e) or "out of memory" in str(e).lower()


def _sync(dev) -> None:
    import torch
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _batch(dev, mb: int, seq: int, vocab: int) -> dict:
    import torch
    g = torch.Generator(device=dev).manual_seed(mb)
    ids = torch.randint(0, vocab, (mb, seq + 1), device=dev, generator=g)
    return {"input_ids": ids[:, :-1].contiguous(), "labels": ids[:, 1:].contiguous()}


def _compile_stats() -> dict:
    try:
        from torch._dynamo.utils import counters
        return {"unique_graphs": int(counters["stats"]["unique_graphs"]),
                "graph_breaks": int(sum(counters["graph_break"].values()))}
    except Exception:      # private API: report nothing rather than fail the row
        return {}


def _start_over(compiled: bool) -> None:
    free_memory()
    if compiled:     # a fresh dynamo cache per compiled run: no recompile limit reached, no stale graphs
        import torch._dynamo
        from torch._dynamo.utils import counters
        torch._dynamo.reset()
        counters.clear()     # reset() keeps them: each run's unique_graphs would include the runs before it


def _measure(step, dev, plan: Plan, mb: int, result_kwargs: dict) -> Result:
    """Warm up, then time `plan.timed` steps between two device syncs; peaks from after the warm-up."""
    import torch

    from bunsan.memory.measure import peak_rss_bytes, reset_peak_memory
    start = time.perf_counter()
    losses = [step()]
    first = time.perf_counter() - start
    for _ in range(plan.warmup - 1):
        losses.append(step())
    _sync(dev)
    reset_peak_memory(dev)
    start = time.perf_counter()
    for _ in range(plan.timed):
        losses.append(step())
    _sync(dev)
    seconds = time.perf_counter() - start
    out = Result(mb, mb * plan.seq * plan.timed / seconds, seconds / plan.timed, first,
                 [float(x) for x in losses], **result_kwargs)
    if dev.type == "cuda":
        out.peak_allocated = torch.cuda.max_memory_allocated(dev)
        out.peak_reserved = torch.cuda.max_memory_reserved(dev)
    out.peak_rss = peak_rss_bytes()
    return out


def _search(run_at, plan: Plan, start: int | None, row) -> Result:
    """The largest micro-batch (from `start` down) whose steps fit; each miss is recorded with why."""
    tried = []
    for mb in [m for m in plan.micro_batches if start is None or m <= start]:
        try:
            result = run_at(mb)
            result.tried = tried
            return result
        except Exception as e:
            if not _is_oom(e):
                raise
            tried.append((mb, f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"))
        free_memory()
    row.numbers["tried"] = tried
    raise RowFailed(f"no micro-batch of {list(plan.micro_batches)} fits: {tried}")


def main(section: Section) -> None:
    import torch
    import torch.nn.functional as F

    import bunsan
    from bunsan.training.metrics import peak_flops
    from bunsan.models import Llama, flops_per_token

    dry = section.dry_run
    dev = device(dry)
    plan = DRY_PLAN if dry else GPU_PLAN
    section.plan([MATMUL_ROW] + [r[0] for r in RUNS] + [memory_row(r[0]) for r in RUNS if r[1] == "bunsan"])
    cfg = llama_config(plan.preset, **plan.model)
    flops_tok = flops_per_token(cfg, plan.seq)
    peak = peak_flops(dev)
    peak_name = (f"{torch.cuda.get_device_name(dev)}: {peak / 1e12:.1f} TFLOP/s dense bf16 (NVIDIA datasheet, "
                 "bunsan.metrics.PEAK_BF16_FLOPS)") if peak else "none known for this device (no MFU)"
    results: dict[str, Result] = {}
    simulate = {"left": dry}        # the dry run's simulated out-of-memory, once

    def matmul(row):
        n, dtype = plan.matmul, (torch.bfloat16 if dev.type == "cuda" else torch.float32)
        a, b = (torch.randn(n, n, device=dev, dtype=dtype) for _ in range(2))
        for _ in range(3):
            a @ b
        _sync(dev)
        iters = 10 if dev.type == "cuda" else 3
        start = time.perf_counter()
        for _ in range(iters):
            a @ b
        _sync(dev)
        rate = 2 * n ** 3 * iters / (time.perf_counter() - start)
        row.numbers.update(n=n, dtype=str(dtype).removeprefix("torch."), flops_per_s=rate, peak_flops=peak,
                           peak=peak_name, of_peak=rate / peak if peak else None)
        row.headline = f"{n}^3 {row.numbers['dtype']}: {rate / 1e12:.1f} TFLOP/s" + (
            f" = {rate / peak:.0%} of the datasheet's {peak / 1e12:.1f}" if peak else "")
        results["matmul"] = rate

    def bunsan_at(compiled: bool, checkpointing: bool, mb: int) -> Result:
        _start_over(compiled)
        config = {"train_micro_batch_size_per_gpu": mb, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "data": {"seq_len": plan.seq},
                  "activation_checkpointing": {"enabled": checkpointing}, "train": {"compile": compiled}}
        torch.manual_seed(0)
        # built (and drawn) on the GPU: a meta model would be materialised with bunsan's seeded init, which
        # draws each weight on the CPU for device-independent values (seconds per 1B build, here only waste)
        with torch.device(dev):
            model = Llama(llama_config(plan.preset, **plan.model))
        engine = bunsan.initialize(model, config)
        if simulate["left"] and mb > DRY_SIMULATED_OOM_ABOVE:
            simulate["left"] = False

            def refuse(*_):
                raise torch.OutOfMemoryError(f"simulated by the dry run: micro-batch {mb} > "
                                             f"{DRY_SIMULATED_OOM_ABOVE} does not fit")
            engine.module.register_forward_pre_hook(refuse)
        batch = _batch(dev, mb, plan.seq, cfg.vocab_size)
        try:
            result = _measure(lambda: engine.train_batch(batch), dev, plan, mb, {"config": config})
            result.report = engine.memory_report()
            result.compile_stats = _compile_stats() if compiled else {}
            return result
        finally:      # let go of the model at once, also while an out-of-memory error propagates
            engine = model = batch = None

    def torch_at(compiled: bool, mb: int) -> Result:
        _start_over(compiled)
        torch.manual_seed(0)
        with torch.device(dev):
            model = Llama(llama_config(plan.preset, **plan.model))
        if compiled:        # as bunsan's apply_compile: each block, the repeated blocks sharing one graph
            for block in model.layers:
                block.compile()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        batch = _batch(dev, mb, plan.seq, cfg.vocab_size)

        def step():
            with torch.autocast(dev.type, dtype=torch.bfloat16):
                logits = model(batch["input_ids"])
            loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), batch["labels"].reshape(-1))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.detach()
        try:
            result = _measure(step, dev, plan, mb, {})
            result.compile_stats = _compile_stats() if compiled else {}
            return result
        finally:
            model = opt = batch = None

    def first_micro_batch(checkpointing: bool) -> int | None:
        """The largest candidate the estimator says fits 92% of the GPU (the search starts there)."""
        if dev.type != "cuda":
            return None
        total = torch.cuda.get_device_properties(dev).total_memory
        for mb in plan.micro_batches:
            est = bunsan.estimate(cfg, {"train_micro_batch_size_per_gpu": mb, "bf16": {"enabled": True},
                                        "data": {"seq_len": plan.seq},
                                        "activation_checkpointing": {"enabled": checkpointing}},
                                  gpus=1, device_type="cuda")
            if est.peak <= 0.92 * total:
                return mb
        return plan.micro_batches[-1]

    def run(row, name, who, wanted_compile, checkpointing):
        compiled = wanted_compile and plan.compile
        if who == "bunsan":
            same = results.get("bunsan eager" + (" checkpointing" if checkpointing else ""))
            start = same.micro_batch if wanted_compile and same else first_micro_batch(checkpointing)
            result = _search(lambda mb: bunsan_at(compiled, checkpointing, mb), plan, start, row)
        else:
            ours = results.get("bunsan compiled" if wanted_compile else "bunsan eager")
            result = _search(lambda mb: torch_at(compiled, mb), plan, ours.micro_batch if ours else None, row)
        results[name] = result
        check(all(math.isfinite(x) for x in result.losses), f"non-finite loss: {result.losses}")
        mfu = result.tokens_per_s * flops_tok / peak if peak else None
        row.numbers.update(preset=plan.preset, seq=plan.seq, micro_batch=result.micro_batch, tried=result.tried,
                           compile=compiled, checkpointing=checkpointing, tokens_per_s=round(result.tokens_per_s, 1),
                           step_s=round(result.step_s, 4), first_step_s=round(result.first_step_s, 2),
                           flops_per_token=flops_tok, mfu=mfu, peak=peak_name, losses=result.losses,
                           peak_allocated=result.peak_allocated, peak_reserved=result.peak_reserved,
                           **result.compile_stats)
        if "matmul" in results:
            row.numbers["of_measured_matmul"] = result.tokens_per_s * flops_tok / results["matmul"]
        row.headline = f"{result.tokens_per_s:,.0f} tokens/s at micro-batch {result.micro_batch}" + (
            f", MFU {mfu:.1%}" if mfu is not None else ", MFU n/a (no known peak)")
        if result.tried:
            row.headline += f" ({', '.join(str(m) for m, _ in result.tried)} did not fit)"
        if wanted_compile and not compiled:
            row.note("dry run: compile off (inductor on two CPU cores would take minutes): this ran eager")
        if who == "bunsan" and "compiled" in name:
            met = None if mfu is None else mfu >= MFU_TARGET
            row.numbers["target_mfu"] = {"target": MFU_TARGET, "met": met}
            row.headline += f"; MFU >= {MFU_TARGET:.0%}: " + ("n/a" if met is None else "met" if met else "NOT met")
        if who == "torch":
            ours = results.get("bunsan compiled" if "compiled" in name else "bunsan eager")
            if ours is not None:
                ratio = ours.tokens_per_s / result.tokens_per_s
                row.numbers["target_bunsan_vs_torch"] = {"ratio": ratio, "met": ratio >= 1.0,
                                                         "bunsan_micro_batch": ours.micro_batch}
                row.headline += f"; bunsan/torch {ratio:.2f} (>= 1: {'met' if ratio >= 1.0 else 'NOT met'})"
            else:
                row.numbers["target_bunsan_vs_torch"] = {"ratio": None, "met": None}

    def memory(row, name):
        result = results.get(name)
        check(result is not None, f"the run '{name}' did not complete, so there is nothing to compare")
        config = result.config
        est = bunsan.estimate(cfg, config, gpus=1, device_type=dev.type)
        items = {i.name: i.device for i in est.items}
        if dev.type == "cuda":   # the allocator's figures hold no CUDA context: compare without it
            predicted = est.peak - items.get("runtime", 0.0)
            measured, what = result.peak_allocated, "torch.cuda.max_memory_allocated after warm-up"
            row.numbers.update(reserved=result.peak_reserved, reserved_ratio=result.peak_reserved / predicted,
                               engine_cuda_peak_allocated=result.report.get("cuda_peak_allocated"),
                               engine_cuda_peak_reserved=result.report.get("cuda_peak_reserved"))
        else:                    # the process's peak resident set (earlier runs' freed heap included)
            predicted = est.peak
            measured, what = result.peak_rss, "peak resident set of the section's process after warm-up"
        ratio = measured / predicted
        met = abs(ratio - 1.0) <= MEMORY_TOLERANCE
        row.numbers.update(measured=measured, measured_as=what, predicted=predicted, ratio=ratio,
                           estimate_peak=est.peak, estimate_items={k: v for k, v in items.items() if v},
                           micro_batch=result.micro_batch, target={"within": MEMORY_TOLERANCE, "met": met},
                           model_states_measured=result.report.get("model_states"),
                           model_states_theory=result.report.get("theory_model_states"))
        gib = 1024 ** 3
        row.headline = (f"measured {measured / gib:.2f} GiB vs estimate {predicted / gib:.2f} GiB: {ratio:.2f}x "
                        f"(within {MEMORY_TOLERANCE:.0%}: {'met' if met else 'NOT met'})")
        if dev.type == "cuda":
            row.headline += f"; reserved {result.peak_reserved / gib:.2f} GiB"
        else:
            row.note("CPU: the estimate prices the process's resident set; the measurement includes what earlier "
                     "runs of this process left in the heap, so the ratio is indicative only")

    section.run(MATMUL_ROW, matmul, 3.0)
    for name, who, compiled, checkpointing, need_s in RUNS:
        need = need_s if not dry else 3.0
        section.run(name, run, need, name, who, compiled, checkpointing)
        if who == "bunsan":      # its memory row: skipped with its run, failed (saying why) if the run failed
            if section.rows[name].status == "skipped":
                section.skip(memory_row(name), f"its run '{name}' was skipped")
            else:
                section.run(memory_row(name), memory, 0.0, name)
