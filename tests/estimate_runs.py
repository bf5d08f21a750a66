"""Real CPU runs of many layouts next to bunsan's estimate of them: shared by tests/test_estimator_measured.py
and benchmarks/bench_estimate.py.

Each layout trains a small Llama for two steps in the gloo pool (dist_harness.py), in ranks of its own. The
peak is the resident set's high-water mark during the second step (the first creates the optimizer states);
the estimate's runtime term is the rank's resident set before the model is built, its parent's library pages
included (resident_as_started).
"""

from __future__ import annotations

import gc
import os
import tempfile
import time

# Big enough that model states and activations outweigh the process's runtime, small enough for CI.
MODEL = dict(vocab_size=8192, hidden_size=512, intermediate_size=1376, num_hidden_layers=4,
             num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512)
SEQ = 128

# (name, world, config) for the sweep: every ZeRO stage, offload, TP (+SP), PP, checkpointing,
# accumulation, precision and context parallelism.
LAYOUTS = [
    ("zero0", 2, {}),
    ("zero1", 2, {"zero_optimization": {"stage": 1}}),
    ("zero2", 2, {"zero_optimization": {"stage": 2}}),
    ("zero3", 2, {"zero_optimization": {"stage": 3}}),
    ("zero1 offload cpu", 2, {"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}}),
    ("zero3 offload param+opt cpu", 2, {"zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}}),
    ("zero2 offload nvme", 2, {"zero_optimization": {"stage": 2, "offload_optimizer": {
        "device": "nvme", "nvme_path": "@TMP"}}}),
    ("zero0 checkpointing", 2, {"activation_checkpointing": {"enabled": True}}),
    ("zero1 accumulation 4", 2, {"zero_optimization": {"stage": 1}, "gradient_accumulation_steps": 4,
                                 "train_micro_batch_size_per_gpu": 1}),
    ("zero2 bf16", 2, {"zero_optimization": {"stage": 2}, "bf16": {"enabled": True},
                       "train_micro_batch_size_per_gpu": 1}),   # CPU bf16 matmuls are slow: one sample
    ("tp2", 2, {"tensor_parallel": {"size": 2}}),
    ("tp2 sp", 2, {"tensor_parallel": {"size": 2, "sequence_parallel": True}}),
    ("pp2 1f1b m4", 2, {"pipeline": {"stages": 2}, "gradient_accumulation_steps": 4,
                        "train_micro_batch_size_per_gpu": 1}),
    ("zero0 SGD", 2, {"optimizer": {"type": "SGD", "params": {"lr": 0.01, "momentum": 0.9}}}),
    ("cp2", 2, {"context_parallel": {"size": 2}}),
]


def base_config(extra: dict, tmp: str) -> dict:
    import copy
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "data": {"seq_len": SEQ}, "train": {"timeout_s": 60}}
    for k, v in copy.deepcopy(extra).items():
        cfg[k] = {**cfg[k], **v} if isinstance(v, dict) and isinstance(cfg.get(k), dict) else v
    off = cfg.get("zero_optimization", {}).get("offload_optimizer")
    if off and off.get("nvme_path") == "@TMP":
        off["nvme_path"] = tmp
    return cfg


def resident_as_started() -> int:
    """Make resident, in this forked rank, every page of a file mapping (libraries' code and data) that its
    parent, the harness's forkserver, holds resident; the pages made resident.

    Why: the kernel copies a forked process's page tables of anonymous memory only, so a rank starts without
    its parent's library pages mapped; they come back as the first step runs them, after the baseline was
    read, and land in the peak as if the layout had allocated them (about 50 MiB: zero0's estimate went from
    0.97 to 0.91 of the peak). A process that imported torch itself, as the estimate's runtime term means
    (`bunsan estimate` prices the process before the model), holds them before any step. The libraries are
    mapped at the same addresses in parent and child; only a mapping both have, of the same file, is touched."""
    import array
    import ctypes
    page = os.sysconf("SC_PAGE_SIZE")

    def file_maps(pid) -> dict:
        out = {}
        with open(f"/proc/{pid}/maps") as f:
            for line in f:
                fields = line.split()
                path = fields[5] if len(fields) > 5 else ""
                if path.startswith("/") and not path.startswith("/dev/") and fields[1].startswith("r"):
                    out[fields[0]] = path
        return out
    ours, touched = file_maps("self"), 0
    try:
        parents, pagemap = file_maps(os.getppid()), open(f"/proc/{os.getppid()}/pagemap", "rb")
    except OSError:          # not Linux, or the parent's memory not ours to read: the rank's own resident set
        return 0
    with pagemap:
        for span, path in parents.items():
            if ours.get(span) != path:
                continue
            start, end = (int(x, 16) for x in span.split("-"))
            pagemap.seek(start // page * 8)
            entries = array.array("Q", pagemap.read((end - start) // page * 8))
            for i, entry in enumerate(entries):
                if entry >> 63:                 # present in the parent's memory
                    ctypes.string_at(start + i * page, 1)
                    touched += 1
    return touched


def run_layout(rank: int, extra: dict, timed_steps: int = 1) -> dict:
    """One layout on this rank: (estimate inputs, measured report); called in every pool worker.
    The peak is that of the first timed step; `seconds` is the median of `timed_steps` steps."""
    import torch
    import bunsan
    from bunsan.memory.measure import current_rss_bytes, reset_peak_memory
    from bunsan.models.llama import LlamaConfig
    from bunsan.zero.host_buffer import trim_heap

    gc.collect()
    trim_heap()
    resident_as_started()
    baseline = current_rss_bytes()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = base_config(extra, tmp)
        torch.manual_seed(0)
        model = bunsan.models.Llama(LlamaConfig(**MODEL))
        engine = bunsan.initialize(model, cfg)
        rows = engine.micro_batch * engine.grad_accum
        g = torch.Generator().manual_seed(rank)
        ids = torch.randint(0, MODEL["vocab_size"], (rows, SEQ + 1), generator=g)
        batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}
        engine.train_batch(batch)
        gc.collect()
        reset_peak_memory()
        times = []
        for k in range(timed_steps):
            t0 = time.perf_counter()
            engine.train_batch(batch)
            times.append(time.perf_counter() - t0)
            if k == 0:
                report = engine.memory_report()
        seconds = sorted(times)[len(times) // 2]
        out = {"baseline": baseline, "peak": report["peak_rss"], "model_states": report["model_states"],
               "disk": report["disk"], "seconds": seconds, "tokens": rows * SEQ * engine.dp_size,
               "pp_rank": engine.pp_rank, "world": int(os.environ.get("WORLD_SIZE", "1"))}
        del engine, model
    gc.collect()
    trim_heap()
    return out


def estimate_for(extra: dict, world: int, baseline: float):
    from bunsan.estimator import estimate
    from bunsan.models.llama import LlamaConfig
    return estimate(LlamaConfig(**MODEL), base_config(extra, "/tmp"), gpus=world, device_type="cpu",
                    runtime_bytes=baseline)
