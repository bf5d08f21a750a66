"""DeepSpeed drop-in: one DeepSpeed-style script run with DeepSpeed itself and with bunsan.deepspeed, side by side.

`train()` below is written against the `deepspeed` API only (initialize(model=, model_parameters=, config=),
engine(x), engine.backward(loss), engine.step(), engine.get_lr(), engine.global_steps). Each case runs it
twice, in fresh spawned 2-rank processes (gloo, one thread per rank), one side after the other:

  deepspeed   `import deepspeed` (DeepSpeed 0.19.8, DS_ACCELERATOR=cpu)
  bunsan      `import bunsan.deepspeed as deepspeed`

Both sides start from the same weights (seeded, built before initialize, the same on every rank) and see the
same per-rank micro-batches. Per optimizer step we record the loss (mean over the step's micro-batches and the
ranks) and the lr the step applied, and compare the curves: an fp32 case passes when the largest
|Δloss|/loss is <= 1e-5 (bf16 cases are reported, see RESULTS.md for why they may differ). Exit code 1 when
an fp32 case fails or any side crashes.

    python benchmarks/bench_deepspeed.py                                  # every case, 20 steps
    python benchmarks/bench_deepspeed.py --cases fp32-z0,fp32-z3 --steps 5 --json out.json --markdown out.md
"""
from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import shlex
import sys
import time
import traceback
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

from bench_dp import machine, spawn_ranks
from bench_zero import deepspeed_version, failure_reason

WORLD = 2
SIDES = {"deepspeed": "deepspeed", "bunsan": "bunsan.deepspeed"}   # side -> the module imported as `deepspeed`
VOCAB, HIDDEN, LAYERS, SEQ, MICRO_BATCH = 256, 64, 2, 32, 4
TOLERANCE = 1e-5
ADAMW = {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.01,
                                     "torch_adam": True}}   # torch.optim.AdamW on both sides (no fused/C++ Adam)
SGD = {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}}   # DeepSpeed: getattr(torch.optim, "SGD")
CLIP = 0.5   # below this model's gradient norm (about 0.7): clipping acts at every step
WARMUP = {"type": "WarmupLR", "params": {"warmup_min_lr": 3e-4, "warmup_max_lr": 3e-3, "warmup_num_steps": 10}}

# case -> (dtype, ZeRO stage, optimizer, gradient_accumulation_steps, gradient_clipping, scheduler)
CASES: dict[str, tuple] = {
    **{f"fp32-z{s}": ("fp32", s, ADAMW, 1, CLIP, None) for s in range(4)},
    **{f"bf16-z{s}": ("bf16", s, ADAMW, 1, CLIP, None) for s in range(4)},
    # without clipping: the bf16 steps then differ only where the two frameworks' bf16 paths do (RESULTS.md)
    **{f"bf16-z{s}-noclip": ("bf16", s, ADAMW, 1, 0.0, None) for s in (0, 1, 3)},
    "bf16-z0-sgd": ("bf16", 0, SGD, 1, 0.0, None),
    "fp32-z0-sgd": ("fp32", 0, SGD, 1, 0.0, None),
    "fp32-z2-sgd": ("fp32", 2, SGD, 1, 0.0, None),
    "fp32-z2-gas2": ("fp32", 2, ADAMW, 2, CLIP, None),
    "fp32-z1-warmuplr": ("fp32", 1, ADAMW, 1, 0.0, WARMUP),
}


def ds_config(case: str) -> dict:
    """The DeepSpeed JSON both sides get, unchanged."""
    dtype, stage, optimizer, gas, clip, scheduler = CASES[case]
    cfg = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": gas,
           "steps_per_print": 10 ** 9, "gradient_clipping": clip, "optimizer": optimizer,
           "bf16": {"enabled": dtype == "bf16"},
           # 0: every parameter is partitioned at stage 3 (the model is small enough that DeepSpeed's default
           # 1e5 would keep all of them gathered and the stage-3 path would not be exercised)
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    if optimizer["type"] == "SGD" and stage > 0:
        cfg["zero_allow_untested_optimizer"] = True   # DeepSpeed's ZeRO asks for it (SGD is not on its list)
    if scheduler is not None:
        cfg["scheduler"] = scheduler
    return cfg


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.fc1 = nn.Linear(HIDDEN, 4 * HIDDEN)
        self.fc2 = nn.Linear(4 * HIDDEN, HIDDEN)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class TinyLM(nn.Module):
    """Token ids in (so bf16 needs no input cast), logits out; `layers` are bunsan's ZeRO-3 units."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, ids):
        h = self.embed(ids)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))


def make_data(steps: int, gas: int, rank: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """steps x gas micro-batches of (ids, labels) for this rank; a fixed generator per (step, micro, rank).
    Labels follow a noisy rule (3 id + 7 mod vocab, else random) so that the loss falls within 20 steps."""
    out = []
    for step in range(steps):
        micro = []
        for m in range(gas):
            g = torch.Generator().manual_seed(4321 + 1000 * step + 10 * m + rank)
            ids = torch.randint(VOCAB, (MICRO_BATCH, SEQ), generator=g)
            noise = torch.randint(VOCAB, (MICRO_BATCH, SEQ), generator=g)
            labels = torch.where(torch.rand(MICRO_BATCH, SEQ, generator=g) < 0.8, (3 * ids + 7) % VOCAB, noise)
            micro.append((ids, labels))
        out.append(micro)
    return out


def train(deepspeed, model: nn.Module, config: dict, data) -> list[dict]:
    """The DeepSpeed-style training loop both sides run: one optimizer step per entry of `data` (a list of
    gradient_accumulation_steps micro-batches). Returns per step this rank's mean loss and the lr applied."""
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    device = deepspeed.accelerator.get_accelerator().device_name(engine.local_rank)
    records = []
    for micro in data:
        losses, lr = [], None
        for x, y in micro:
            logits = engine(x.to(device))
            # in fp32 on both sides: the loss of bf16 logits is then computed the same way
            loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), y.to(device).reshape(-1))
            engine.backward(loss)
            if engine.is_gradient_accumulation_boundary():
                lr = engine.get_lr()[0]   # what this optimizer step applies; the scheduler moves it after
            engine.step()
            losses.append(loss.item())
        norm = engine.get_global_grad_norm()   # DeepSpeed: None where it computed none (no clipping, no ZeRO)
        records.append({"loss": sum(losses) / len(losses), "lr": lr, "global_steps": engine.global_steps,
                        "grad_norm": None if norm is None else float(norm)})
    return records


def _worker(rank: int, contender: str, port: int, a: dict, outdir: str) -> None:
    case, side = contender.split(".")
    torch.set_num_threads(1)  # one core per rank
    warnings.filterwarnings("ignore", category=FutureWarning)  # torch's deprecation notes on DeepSpeed's calls
    # The env:// variables a launcher sets; both sides' init_distributed read them.
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_SIZE=str(WORLD),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    deepspeed = importlib.import_module(SIDES[side])
    deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=a["timeout"]))
    torch.manual_seed(0)  # same initial weights on both sides and every rank
    model = TinyLM()
    records = train(deepspeed, model, ds_config(case), make_data(a["steps"], CASES[case][3], rank))
    with open(os.path.join(outdir, f"{contender}-{rank}.json"), "w") as f:
        json.dump({"rank": rank, "records": records}, f)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def curve(ranks: list[dict]) -> dict:
    """Per step: the loss averaged over ranks (equal tokens per rank: the global mean), rank 0's lr."""
    steps = zip(*(r["records"] for r in ranks))
    recs = [list(s) for s in steps]
    return {"loss": [sum(r["loss"] for r in s) / len(s) for s in recs],
            **{k: [s[0][k] for s in recs] for k in ("lr", "global_steps", "grad_norm")}}


def compare(ds: dict, bs: dict) -> dict:
    rel = [abs(a - b) / abs(a) for a, b in zip(ds["loss"], bs["loss"])]
    dlr = [abs(a - b) for a, b in zip(ds["lr"], bs["lr"])]
    worst = max(range(len(rel)), key=rel.__getitem__)
    norms = [abs(a - b) / a for a, b in zip(ds["grad_norm"], bs["grad_norm"]) if a and b is not None]
    return {"max_rel_loss": max(rel), "worst_step": worst + 1, "max_abs_lr": max(dlr),
            "max_rel_grad_norm": max(norms) if norms else None,   # informative: not part of the verdict
            "first_lr_mismatch": next((i + 1 for i, d in enumerate(dlr) if d > 1e-12), None),
            "global_steps_equal": ds["global_steps"] == bs["global_steps"]}


def run_case(case: str, args: argparse.Namespace, console) -> dict:
    """Both sides of one case; a side's crash is recorded with its reason (and printed in full)."""
    out: dict = {"case": case, "config": ds_config(case)}
    for side in SIDES:
        t0 = time.perf_counter()
        try:
            out[side] = curve(spawn_ranks(_worker, f"{case}.{side}", WORLD, args))
            console.print(f"  {case} {side}: done in {time.perf_counter() - t0:.1f} s")
        except Exception as e:
            out[side] = {"failed": failure_reason(e)}
            print(f"{case} {side} FAILED:\n{traceback.format_exc()}", file=sys.stderr)
    if "loss" in out["deepspeed"] and "loss" in out["bunsan"]:
        out["compare"] = compare(out["deepspeed"], out["bunsan"])
    return out


def verdict(r: dict) -> str:
    if "compare" not in r:
        return "FAILED"
    c = r["compare"]
    ok = c["max_rel_loss"] <= TOLERANCE and c["max_abs_lr"] <= 1e-12 and c["global_steps_equal"]
    if CASES[r["case"]][0] == "bf16":
        return "within 1e-5" if ok else "differs (bf16, reported)"
    return "pass" if ok else "FAIL"


def build_rows(results: list[dict], steps: int) -> tuple[list[str], list[list[str]]]:
    header = ["case", "steps", "max \\|Δloss\\|/loss (step)", "max \\|Δlr\\|", "first / last loss (DeepSpeed)",
              "result"]
    rows = []
    for r in results:
        if "compare" not in r:
            why = "; ".join(f"{s}: {r[s]['failed']}" for s in SIDES if "failed" in r[s])
            rows.append([r["case"], str(steps), "-", "-", "-", f"FAILED ({why})"])
            continue
        c, ds = r["compare"], r["deepspeed"]
        rows.append([r["case"], str(steps), f"{c['max_rel_loss']:.2e} ({c['worst_step']})", f"{c['max_abs_lr']:.1e}",
                     f"{ds['loss'][0]:.6f} / {ds['loss'][-1]:.6f}", verdict(r)])
    return header, rows


def markdown(header: list[str], rows: list[list[str]], args: argparse.Namespace) -> str:
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"## DeepSpeed drop-in: bunsan.deepspeed vs DeepSpeed {deepspeed_version()}, same script", "",
             f"- date: {now}", f"- machine: {machine()}, deepspeed {deepspeed_version()}",
             f"- command: `python {shlex.join(sys.argv)}`",
             f"- {WORLD} ranks, gloo, 1 thread/rank; TinyLM (vocab {VOCAB}, hidden {HIDDEN}, {LAYERS} blocks), "
             f"micro-batch {MICRO_BATCH} x seq {SEQ}; pass: max |Δloss|/loss <= {TOLERANCE:g} and equal lrs", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default=",".join(CASES), help=f"comma list of {', '.join(CASES)}")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps per case")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per side of a case before its ranks are killed")
    p.add_argument("--json", metavar="PATH", help="write every curve and comparison to PATH")
    p.add_argument("--markdown", metavar="PATH", help="append a markdown section with the table to PATH")
    args = p.parse_args(argv)
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    if unknown := [c for c in cases if c not in CASES]:
        p.error(f"unknown case(s) {', '.join(unknown)}; choose from {', '.join(CASES)}")
    if args.steps < 1:
        p.error("--steps must be >= 1")
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # inherited by the spawned ranks
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed on CPU, whatever it would auto-detect

    from rich.console import Console
    console = Console(width=max(160, Console().width))
    console.print(f"[bold]bench_deepspeed[/]: {len(cases)} case(s), {args.steps} steps, {WORLD} ranks; "
                  f"{machine()}, deepspeed {deepspeed_version()}")
    results = [run_case(c, args, console) for c in cases]
    header, rows = build_rows(results, args.steps)
    text = markdown(header, rows, args)
    console.print(text, markup=False, highlight=False)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"steps": args.steps, "tolerance": TOLERANCE, "results": results}, f, indent=1)
    if args.markdown:
        with open(args.markdown, "a") as f:
            f.write(text + "\n")
        console.print(f"appended to {args.markdown}")
    failed = [r for r in results if verdict(r) in ("FAIL", "FAILED")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
