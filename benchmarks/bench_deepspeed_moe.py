"""DeepSpeed drop-in, mixture of experts: DeepSpeedExamples' CIFAR `--moe` script under DeepSpeed and bunsan.deepspeed.

`train()` below follows training/cifar/cifar10_deepspeed.py of DeepSpeedExamples run with `--moe` (run_ds_moe.sh,
run_ds_prmoe.sh), written against the `deepspeed` API only: a small conv net whose head is a list of
`deepspeed.moe.layer.MoE` layers (each applied as `x, _, _ = layer(x)`, the gate's l_aux ignored), the optimizer
parameters split by `deepspeed.moe.utils.split_params_into_different_moe_groups_for_optimizer` (the script's
--moe-param-group), `deepspeed.initialize(args=, model=, model_parameters=, config=)` with the script's config
(get_ds_config: train_batch_size 16, Adam, WarmupLR, clipping 1.0; fp32 here, steps_per_print large), then
`engine(x)`, CrossEntropyLoss, `engine.backward(loss)`, `engine.step()`. Each case runs it twice, in fresh
spawned 2-rank processes (gloo, one thread per rank), one side after the other:

  deepspeed   `import deepspeed` (DeepSpeed 0.19.8, DS_ACCELERATOR=cpu)
  bunsan      `import bunsan.deepspeed as deepspeed`

Data: synthetic CIFAR-shaped images instead of the download (a seeded class prototype plus noise, [3, 32, 32],
labels 0..9), the same on both sides; each optimizer step takes the next 16 images, rank r the r-th 8 of them.
Seeds: `torch.manual_seed(0)` before the model is built on every rank (every rank starts from the same dense and
expert weights, where the script relies on DeepSpeed's broadcast), then `torch.manual_seed(1000 + rank)` after
`initialize` and before the first step: the gate's random draws (RSample's Gumbel noise, Random Token Selection's
uniform, top-2's sampled second expert) come from torch's default generator, so they are a fixed function of
the rank on both sides. Per optimizer step we record the loss averaged over the ranks (an all_reduce) and the lr
the step applied, and, through a forward hook on every MoE layer (the net ignores them), each layer's l_aux and
per-rank expert counts. An fp32 case passes when the largest |Δloss|/loss is <= 1e-5 and the lrs agree; the
routing (expert counts per step) is reported beside it. Exit code 1 when a case fails or a side crashes (a FAILED
row with the reason); `--sides deepspeed` runs one side only (rows "ran (one side)").

What the curves can tell: the config's WarmupLR (0 -> 1e-3 over 1000 steps, log-shaped) applies lr 0 at steps 1
and 2 and about 3e-4 at step 10; the gradient norm stays near 0.15-0.42, under the clipping threshold 1.0. Over
10 steps DeepSpeed's curve moves about 1e-3 (relative) from its updates, so 1e-5 catches a missing or wrong
update, not an lr that is 1% off. DeepSpeed's "Adam" here is its FusedAdam in AdamW mode (the CPU build, JIT-built
on the first run like its shared-memory comm op: a C++ compiler is needed).

    PYTHONPATH=. /tmp/dsvenv/bin/python benchmarks/bench_deepspeed_moe.py                   # every case, 20 steps
    PYTHONPATH=. /tmp/dsvenv/bin/python benchmarks/bench_deepspeed_moe.py --sides deepspeed --steps 10
    PYTHONPATH=. /tmp/dsvenv/bin/python benchmarks/bench_deepspeed_moe.py --cases prmoe-ep2 --json out.json
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
TRAIN_BATCH = 16                      # get_ds_config's train_batch_size: 16 / WORLD images per rank and step
MICRO_BATCH = TRAIN_BATCH // WORLD
TOLERANCE = 1e-5
MODEL_SEED, DATA_SEED, NOISE_SEED = 0, 4321, 1000   # the gate's noise: NOISE_SEED + rank, set after initialize

# case -> the script's MoE flags (--num-experts, --ep-world-size, --top-k, --mlp-type, --noisy-gate-policy,
# --min-capacity) and --stage; `drop_tokens` is MoE's own keyword (the script leaves it at its default, True).
CASES: dict[str, dict] = {
    # run_ds_moe.sh: 2 experts over 2 ranks (one each), top-1 with RSample noise, ZeRO 0 (the script's default)
    "moe-ep2-top1-rsample": dict(num_experts=[2], ep=2, k=1, mlp_type="standard", noise="RSample", stage=0),
    "moe-ep2-top1-rsample-z1": dict(num_experts=[2], ep=2, k=1, mlp_type="standard", noise="RSample", stage=1),
    "moe-ep2-top1-rsample-z2": dict(num_experts=[2], ep=2, k=1, mlp_type="standard", noise="RSample", stage=2),
    # run_ds_prmoe.sh: pyramid-residual MoE, two layers of 2 and 4 experts, residual MLP (the shared fc3)
    "prmoe-ep2": dict(num_experts=[2, 4], ep=2, k=1, mlp_type="residual", noise="RSample", stage=0),
    # top-2 gating without noisy_gate_policy (its second expert is still Gumbel-sampled: MoE's
    # top2_2nd_expert_sampling defaults to True); experts replicated on both ranks (EP 1)
    "moe-ep1-top2": dict(num_experts=[4], ep=1, k=2, mlp_type="standard", noise=None, stage=0),
    # top-2 over 2 ranks with drop_tokens=False (capacity = the largest expert count, MAX over the EP group)
    "moe-ep2-top2-nodrop": dict(num_experts=[4], ep=2, k=2, mlp_type="standard", noise=None, stage=0,
                                drop_tokens=False),
    # run_ds_moe.sh's layer with the warm-up cut to 2 steps (lr 1e-3 from step 3): every step moves the
    # weights, so an update off by 1% shows in the curve (the script's 1000-step warm-up hides it)
    "moe-ep2-top1-rsample-fastlr": dict(num_experts=[2], ep=2, k=1, mlp_type="standard", noise="RSample",
                                        stage=0, warmup_steps=2),
}
for _c in CASES.values():
    _c.setdefault("min_capacity", 0)      # the script's --min-capacity default (MoE's own default is 4)
    _c.setdefault("drop_tokens", True)
    _c.setdefault("warmup_steps", 1000)   # get_ds_config's WarmupLR


def ds_config(case: str) -> dict:
    """get_ds_config of the script for --dtype fp32 --stage N, steps_per_print raised out of the way."""
    stage = CASES[case]["stage"]
    return {
        "train_batch_size": TRAIN_BATCH,
        "steps_per_print": 10 ** 9,
        "optimizer": {"type": "Adam", "params": {"lr": 0.001, "betas": [0.8, 0.999], "eps": 1e-8,
                                                 "weight_decay": 3e-7}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.001,
                                                     "warmup_num_steps": CASES[case]["warmup_steps"]}},
        "gradient_clipping": 1.0,
        "prescale_gradients": False,
        "bf16": {"enabled": False},
        "fp16": {"enabled": False, "fp16_master_weights_and_grads": False, "loss_scale": 0,
                 "loss_scale_window": 500, "hysteresis": 2, "min_loss_scale": 1, "initial_scale_power": 15},
        "wall_clock_breakdown": False,
        "zero_optimization": {"stage": stage, "allgather_partitions": True, "reduce_scatter": True,
                              "allgather_bucket_size": 50000000, "reduce_bucket_size": 50000000,
                              "overlap_comm": True, "contiguous_gradients": True, "cpu_offload": False},
    }


def script_args(case: str, rank: int) -> argparse.Namespace:
    """The namespace the script's parser builds for the case (it passes it to initialize as args=)."""
    c = CASES[case]
    return argparse.Namespace(epochs=1, local_rank=rank, log_interval=2000, dtype="fp32", stage=c["stage"],
                              moe=True, ep_world_size=c["ep"], num_experts=list(c["num_experts"]),
                              mlp_type=c["mlp_type"], top_k=c["k"], min_capacity=c["min_capacity"],
                              noisy_gate_policy=c["noise"], moe_param_group=True,
                              deepspeed=True, deepspeed_config=None)


def make_net(deepspeed, case: str) -> nn.Module:
    """The script's Net with --moe: conv/pool/conv/pool, fc1 400->120, fc2 120->84, the MoE layers, fc4 84->10."""
    c = CASES[case]
    moe_layer = deepspeed.moe.layer

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = nn.Conv2d(3, 6, 5)
            self.pool = nn.MaxPool2d(2, 2)
            self.conv2 = nn.Conv2d(6, 16, 5)
            self.fc1 = nn.Linear(16 * 5 * 5, 120)
            self.fc2 = nn.Linear(120, 84)
            # One Linear handed to every MoE layer: each layer deep-copies it per local expert, and a residual
            # layer also keeps it (the same module, so shared between layers) as its dense MLP.
            fc3 = nn.Linear(84, 84)
            self.moe_layer_list = nn.ModuleList(
                moe_layer.MoE(hidden_size=84, expert=fc3, num_experts=n_e, ep_size=c["ep"],
                              use_residual=c["mlp_type"] == "residual", k=c["k"], min_capacity=c["min_capacity"],
                              noisy_gate_policy=c["noise"], **({} if c["drop_tokens"] else {"drop_tokens": False}))
                for n_e in c["num_experts"])
            self.fc4 = nn.Linear(84, 10)

        def forward(self, x):
            x = self.pool(F.relu(self.conv1(x)))
            x = self.pool(F.relu(self.conv2(x)))
            x = x.view(-1, 16 * 5 * 5)
            x = F.relu(self.fc1(x))
            x = F.relu(self.fc2(x))
            for layer in self.moe_layer_list:
                x, _, _ = layer(x)
            return self.fc4(x)

    return Net()


def make_data(steps: int, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One (images, labels) micro-batch per step for this rank: the step's 16 images, this rank's 8.
    An image is its label's fixed prototype plus noise (roughly the [-1, 1] range of the script's transform),
    so that the classes are learnable."""
    protos = torch.rand(10, 3, 32, 32, generator=torch.Generator().manual_seed(DATA_SEED)) * 2 - 1
    out = []
    for step in range(steps):   # a generator per step: a shorter run's data is a prefix of a longer one's
        g = torch.Generator().manual_seed(DATA_SEED + 1 + step)
        labels = torch.randint(10, (TRAIN_BATCH,), generator=g)
        images = 0.5 * protos[labels] + 0.5 * (torch.rand(TRAIN_BATCH, 3, 32, 32, generator=g) * 2 - 1)
        mine = slice(rank * MICRO_BATCH, (rank + 1) * MICRO_BATCH)
        out.append((images[mine].clone(), labels[mine].clone()))
    return out


def _record_gates(net: nn.Module, moe_cls) -> list[list]:
    """Hook every MoE layer: per forward, append [l_aux, exp_counts] (what `x, _, _ = layer(x)` discards)."""
    seen: list[list] = []

    def hook(_module, _inputs, output):
        if isinstance(output, tuple) and len(output) == 3:
            l_aux, counts = output[1], output[2]
            seen.append([float(l_aux.detach()) if torch.is_tensor(l_aux) else None,
                         [int(v) for v in counts.tolist()] if torch.is_tensor(counts) else None])

    for m in net.modules():
        if isinstance(m, moe_cls):
            m.register_forward_hook(hook)
    return seen


def train(deepspeed, case: str, rank: int, data) -> list[dict]:
    """The script's training loop, one optimizer step per micro-batch (gradient_accumulation_steps 1).
    Returns per step the loss averaged over the ranks, rank-local l_aux / expert counts, and the lr applied."""
    torch.manual_seed(MODEL_SEED)   # the same dense and expert weights on every rank and both sides
    net = make_net(deepspeed, case)
    gates = _record_gates(net, deepspeed.moe.layer.MoE)
    parameters = deepspeed.moe.utils.split_params_into_different_moe_groups_for_optimizer(
        {"params": [p for p in net.parameters()], "name": "parameters"})
    engine, _, _, _ = deepspeed.initialize(args=script_args(case, rank), model=net, model_parameters=parameters,
                                           config=ds_config(case))
    device = deepspeed.accelerator.get_accelerator().device_name(engine.local_rank)
    criterion = nn.CrossEntropyLoss()
    torch.manual_seed(NOISE_SEED + rank)   # the gate's noise: the default generator, per rank
    records = []
    for inputs, labels in data:
        gates.clear()
        outputs = engine(inputs.to(device))
        loss = criterion(outputs, labels.to(device))
        engine.backward(loss)
        lr = engine.get_lr()[0]   # what this step applies; the scheduler moves it after
        engine.step()
        norm = engine.get_global_grad_norm()   # DeepSpeed: None at ZeRO 0 in fp32 (its clipping keeps none)
        mean = loss.detach().clone().float()
        torch.distributed.all_reduce(mean)
        records.append({"loss": mean.item() / torch.distributed.get_world_size(), "rank_loss": loss.item(),
                        "lr": lr, "global_steps": engine.global_steps,
                        "grad_norm": None if norm is None else float(norm),
                        "l_aux": [g[0] for g in gates], "exp_counts": [g[1] for g in gates]})
    return records


def _worker(rank: int, contender: str, port: int, a: dict, outdir: str) -> None:
    case, side = contender.rsplit(".", 1)
    torch.set_num_threads(1)  # one core per rank
    warnings.filterwarnings("ignore", category=FutureWarning)  # torch's deprecation notes on DeepSpeed's calls
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_SIZE=str(WORLD),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    deepspeed = importlib.import_module(SIDES[side])
    for sub in ("moe.layer", "moe.utils"):   # what the script's `from deepspeed.moe.utils import ...` loads
        importlib.import_module(f"{SIDES[side]}.{sub}")
    deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=a["timeout"]))
    records = train(deepspeed, case, rank, make_data(a["steps"], rank))
    with open(os.path.join(outdir, f"{contender}-{rank}.json"), "w") as f:
        json.dump({"rank": rank, "records": records}, f)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def curve(ranks: list[dict]) -> dict:
    """Per step: the rank-averaged loss and lr (rank 0's), and every rank's l_aux / expert counts."""
    recs = [list(s) for s in zip(*(r["records"] for r in ranks))]
    return {"loss": [s[0]["loss"] for s in recs], "lr": [s[0]["lr"] for s in recs],
            "global_steps": [s[0]["global_steps"] for s in recs], "grad_norm": [s[0]["grad_norm"] for s in recs],
            "rank_loss": [[r["rank_loss"] for r in s] for s in recs],
            "l_aux": [[r["l_aux"] for r in s] for s in recs],
            "exp_counts": [[r["exp_counts"] for r in s] for s in recs]}


def compare(ds: dict, bs: dict) -> dict:
    rel = [abs(a - b) / abs(a) for a, b in zip(ds["loss"], bs["loss"])]
    dlr = [abs(a - b) for a, b in zip(ds["lr"], bs["lr"])]
    worst = max(range(len(rel)), key=rel.__getitem__)
    routing = [i + 1 for i, (a, b) in enumerate(zip(ds["exp_counts"], bs["exp_counts"])) if a != b]
    return {"max_rel_loss": max(rel), "worst_step": worst + 1, "max_abs_lr": max(dlr),
            "global_steps_equal": ds["global_steps"] == bs["global_steps"],
            # informative: the steps whose per-rank expert counts differ (the first is where routing diverged)
            "routing_differs_at": routing[:5], "routing_steps_differing": len(routing)}


def run_case(case: str, args: argparse.Namespace, console) -> dict:
    """Each chosen side of one case; a side's crash is recorded with its reason (and printed in full)."""
    out: dict = {"case": case, "moe": CASES[case], "config": ds_config(case)}
    for side in args.sides:
        t0 = time.perf_counter()
        try:
            out[side] = curve(spawn_ranks(_worker, f"{case}.{side}", WORLD, args))
            ls = out[side]["loss"]
            console.print(f"  {case} {side}: done in {time.perf_counter() - t0:.1f} s, "
                          f"loss {ls[0]:.6f} -> {ls[-1]:.6f}")
        except Exception as e:
            out[side] = {"failed": failure_reason(e)}
            console.print(f"  {case} {side}: FAILED ({out[side]['failed']})", markup=False, highlight=False)
            print(f"{case} {side} FAILED:\n{traceback.format_exc()}", file=sys.stderr)
    if "loss" in out.get("deepspeed", {}) and "loss" in out.get("bunsan", {}):
        out["compare"] = compare(out["deepspeed"], out["bunsan"])
    return out


def verdict(r: dict, sides: list[str]) -> str:
    if any("failed" in r[s] for s in sides):
        return "FAILED"
    if "compare" not in r:
        return "ran (one side)"
    c = r["compare"]
    ok = c["max_rel_loss"] <= TOLERANCE and c["max_abs_lr"] <= 1e-12 and c["global_steps_equal"]
    return "pass" if ok else "FAIL"


def build_rows(results: list[dict], steps: int, sides: list[str]) -> tuple[list[str], list[list[str]]]:
    header = ["case", "experts / EP / k / gate", "ZeRO", "steps", "max \\|Δloss\\|/loss (step)", "max \\|Δlr\\|",
              "routing", "first / last loss (DeepSpeed)", "first / last loss (bunsan)", "result"]
    rows = []
    for r in results:
        m = r["moe"]
        desc = (f"{'+'.join(map(str, m['num_experts']))} / {m['ep']} / {m['k']} / {m['noise'] or 'none'}"
                f"{' residual' if m['mlp_type'] == 'residual' else ''}{'' if m['drop_tokens'] else ' no-drop'}")
        ends = [f"{r[s]['loss'][0]:.6f} / {r[s]['loss'][-1]:.6f}" if "loss" in r.get(s, {}) else "-"
                for s in ("deepspeed", "bunsan")]
        v = verdict(r, sides)
        if v == "FAILED":
            v += " (" + "; ".join(f"{s}: {r[s]['failed']}" for s in sides if "failed" in r[s]) + ")"
        if "compare" in r:
            c = r["compare"]
            routing = ("equal" if not c["routing_steps_differing"] else
                       f"differs at {c['routing_steps_differing']} step(s), first {c['routing_differs_at'][0]}")
            rows.append([r["case"], desc, str(m["stage"]), str(steps),
                         f"{c['max_rel_loss']:.2e} ({c['worst_step']})", f"{c['max_abs_lr']:.1e}", routing, *ends, v])
        else:
            rows.append([r["case"], desc, str(m["stage"]), str(steps), "-", "-", "-", *ends, v])
    return header, rows


def markdown(header: list[str], rows: list[list[str]], args: argparse.Namespace) -> str:
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"## DeepSpeed drop-in, MoE: bunsan.deepspeed vs DeepSpeed {deepspeed_version()}, CIFAR --moe script",
             "", f"- date: {now}", f"- machine: {machine()}, deepspeed {deepspeed_version()}",
             f"- command: `python {shlex.join(sys.argv)}`",
             f"- sides: {', '.join(args.sides)}; {WORLD} ranks, gloo, 1 thread/rank; DeepSpeedExamples' "
             f"cifar10_deepspeed.py Net with --moe (fp32), train_batch_size {TRAIN_BATCH} ({MICRO_BATCH} "
             f"images/rank), synthetic CIFAR-shaped data; pass: max |Δloss|/loss <= {TOLERANCE:g} and equal lrs",
             "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default=",".join(CASES), help=f"comma list of {', '.join(CASES)}")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps per case")
    p.add_argument("--sides", default=",".join(SIDES), help="comma list of deepspeed, bunsan (default both)")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds per side of a case before its ranks are killed")
    p.add_argument("--json", metavar="PATH", help="write every curve and comparison to PATH")
    p.add_argument("--markdown", metavar="PATH", help="append a markdown section with the table to PATH")
    args = p.parse_args(argv)
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    if unknown := [c for c in cases if c not in CASES]:
        p.error(f"unknown case(s) {', '.join(unknown)}; choose from {', '.join(CASES)}")
    args.sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    if not args.sides or any(s not in SIDES for s in args.sides):
        p.error(f"--sides: choose from {', '.join(SIDES)}")
    if args.steps < 1:
        p.error("--steps must be >= 1")
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # inherited by the spawned ranks
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed on CPU, whatever it would auto-detect

    from rich.console import Console
    console = Console(width=max(160, Console().width))
    console.print(f"[bold]bench_deepspeed_moe[/]: {len(cases)} case(s), {args.steps} steps, {WORLD} ranks, "
                  f"sides {', '.join(args.sides)}; {machine()}, deepspeed {deepspeed_version()}")
    results = [run_case(c, args, console) for c in cases]
    header, rows = build_rows(results, args.steps, args.sides)
    text = markdown(header, rows, args)
    console.print(text, markup=False, highlight=False)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"steps": args.steps, "sides": args.sides, "tolerance": TOLERANCE, "results": results}, f,
                      indent=1)
    if args.markdown:
        with open(args.markdown, "a") as f:
            f.write(text + "\n")
        console.print(f"appended to {args.markdown}")
    failed = [r for r in results if verdict(r, args.sides) in ("FAIL", "FAILED")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
