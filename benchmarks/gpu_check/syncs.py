"""Section 3: host syncs per training step under a one-rank NCCL group (the default backend on CUDA at world
size 1), ZeRO 0-3 and ZeRO-3 with CPU offload.

bunsan's step reads the host once, at the optimizer boundary (gradient norm, loss and token count together);
the pipeline reads a header once per stage and step. A sync per layer, per micro-batch or per bucket is a bug
that no CPU test sees (on a CPU the host is the device). On the GPU torch says so itself:
`torch.cuda.set_sync_debug_mode("warn")` warns "called a synchronizing CUDA operation" at every sync; each is
counted with the stack it came from, on every step after the first (which sets things up).

In a dry run (CPU, gloo) there is no CUDA to warn, so host reads are counted instead: a TorchDispatchMode sees
`aten._local_scalar_dense` (what .item(), float(t), int(t), bool(t) read back), and `Tensor.tolist` is counted
where it is called, because on a CPU tensor it reads memory directly and dispatches no op at all. On the GPU
both counts are reported beside the syncs.
"""

from __future__ import annotations

import collections
import contextlib
import warnings

from .common import Section, begin, build_model, check, free_memory, stack, where

MAX_SYNCS_PER_STEP = 8

LAYOUTS = {
    "nccl zero0": {},
    "nccl zero1": {"stage": 1},
    "nccl zero2": {"stage": 2},
    "nccl zero3": {"stage": 3},
    "nccl zero3 offload cpu": {"stage": 3, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}},
}


def _by_design(frames) -> bool:
    """torch's own optimizers read their step counters on the host: they are CPU tensors on every device
    (unless capturable or fused), so these reads never wait for a GPU."""
    return any("/torch/optim/" in f.filename for f in frames)


class HostReads:
    """Counts host reads of tensor values, with where each came from: aten._local_scalar_dense through a
    dispatch mode, and Tensor.tolist calls (patched onto torch.Tensor while counting). `device_only`: count
    only reads of tensors on a GPU (a CPU tensor's read waits for nothing); else (the dry run, where every tensor
    is a CPU one) every read but the optimizers' step counters. What is left out is counted in `by_design`."""

    def __init__(self, device_only: bool):
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode
        reads = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func is torch.ops.aten._local_scalar_dense.default:
                    reads.record(args[0])
                return func(*args, **(kwargs or {}))

        self.torch, self.mode, self.device_only = torch, Mode(), device_only
        self.sources, self.by_design = [], 0

    def record(self, t) -> None:
        frames = stack()
        if (self.device_only and t.device.type == "cpu") or _by_design(frames):
            self.by_design += 1
        else:
            self.sources.append(where(frames))

    def __enter__(self):
        torch = self.torch
        self._own = "tolist" in torch.Tensor.__dict__
        self._tolist = torch.Tensor.tolist
        original, record = self._tolist, self.record

        def tolist(t):
            record(t)
            return original(t)
        torch.Tensor.tolist = tolist
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)
        if self._own:
            self.torch.Tensor.tolist = self._tolist
        else:
            del self.torch.Tensor.tolist
        return False


class CudaSyncs:
    """Counts torch's sync-debug warnings (set_sync_debug_mode("warn")), with the stack each was issued from."""

    def __init__(self):
        self.sources = []

    def __enter__(self):
        import torch
        self._catch = warnings.catch_warnings()
        self._catch.__enter__()
        warnings.simplefilter("always")
        sources = self.sources

        def show(message, category, filename, lineno, file=None, line=None):
            if "synchroniz" in str(message):
                found = where(stack())     # the Python line that made torch sync
                sources.append(found if found != "?" else f"{filename}:{lineno}")
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc):
        import torch
        torch.cuda.set_sync_debug_mode("default")
        self._catch.__exit__(*exc)
        return False


def _top(sources: list[str], n: int = 5) -> dict:
    return dict(collections.Counter(sources).most_common(n))


def main(section: Section) -> None:
    import bunsan
    from bunsan.comm.process_group import backend_name

    dry = section.dry_run
    sz, dev, data = begin(section, LAYOUTS)
    if dry:      # the first step is not counted: one counted step runs every line of the count
        data = data[:2]

    def run(row, zero):
        cfg = {"train_micro_batch_size_per_gpu": sz.rows // 2, "gradient_accumulation_steps": 2,
               "bf16": {"enabled": True}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
               "data": {"seq_len": sz.seq}, "zero_optimization": zero}
        engine = bunsan.initialize(build_model(sz.preset, **sz.model), cfg)
        row.numbers.update(backend=backend_name(), device=str(engine.device), preset=sz.preset,
                           micro_batches_per_step=2, counted_steps=len(data) - 1)
        if dry:
            row.note(f"dry run: {backend_name()} on the CPU; host reads counted (_local_scalar_dense and tolist) "
                     "in place of CUDA sync warnings")
        engine.train_batch(data[0])          # the first step sets up (buffers, cuBLAS handles): not counted
        syncs, reads, by_design = [], [], []
        for batch in data[1:]:
            with contextlib.ExitStack() as scope:
                cuda = scope.enter_context(CudaSyncs()) if dev.type == "cuda" else None
                counter = scope.enter_context(HostReads(device_only=dev.type == "cuda"))
                loss = engine.train_batch(batch)
            reads.append(counter.sources)
            by_design.append(counter.by_design)
            syncs.append(cuda.sources if cuda is not None else counter.sources)
            check(loss == loss, f"loss is {loss}")
        per_step = [len(s) for s in syncs]
        row.numbers.update(syncs_per_step=per_step, host_reads_per_step=[len(r) for r in reads],
                           sync_sources=_top([w for s in syncs for w in s]),
                           host_read_sources=_top([w for r in reads for w in r]),
                           host_reads_not_counted_per_step=by_design,
                           counted_as="cuda sync-debug warnings" if dev.type == "cuda" else
                           "host reads on the CPU: _local_scalar_dense and tolist, less torch.optim's step counters",
                           limit_per_step=MAX_SYNCS_PER_STEP)
        top = next(iter(row.numbers["sync_sources"]), "none")
        row.headline = (f"{'syncs' if dev.type == 'cuda' else 'host reads'}/step {per_step} (at most "
                        f"{MAX_SYNCS_PER_STEP}); most from {top}")
        if dev.type == "cuda":
            row.headline += f"; host reads/step {row.numbers['host_reads_per_step']}"
        check(min(per_step) >= 1, f"counted {per_step} syncs per step, but bunsan's step reads the host once by "
                                  "design: the counter does not see them, so no figure here can be trusted")
        check(max(per_step) <= MAX_SYNCS_PER_STEP,
              f"{max(per_step)} syncs in one step (at most {MAX_SYNCS_PER_STEP}: one at the optimizer boundary is "
              f"bunsan's design); from {row.numbers['sync_sources']}")
        del engine
        free_memory()

    for name, zero in LAYOUTS.items():
        section.run(name, run, 4.0, zero)
