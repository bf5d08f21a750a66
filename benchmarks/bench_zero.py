"""ZeRO on CPU: bunsan stages 0-3 vs torch DDP, torch FSDP2 and DeepSpeed ZeRO 1-3.

Every contender trains the same model from the same weights on the same batches with 2 ranks
(gloo, one thread per rank), in fresh spawned processes, one contender after another:

  ddp        torch DistributedDataParallel, fp32 AdamW                              (ZeRO stage 0 layout)
  fsdp2      torch fully_shard (FSDP2) per transformer block, then the root          (stage 3 layout)
  ds1..ds3   deepspeed.initialize, ZeRO stage 1/2/3, fp32, torch AdamW (torch_adam: true)
  bunsan0..3 bunsan.initialize(model, config).train_batch(batch), ZeRO stage 0..3
  bunsan3o   bunsan stage 3 with offload_optimizer and offload_param on "cpu"
  bunsan3i   bunsan stage 3 with the model built under bunsan.zero.Init (meta device: the full model never
             exists; weights drawn per parameter name, so the loss differs slightly from the others)

Model-state bytes per rank follow the ZeRO paper in fp32 with Adam (Ψ params, N ranks):
stage 0 16Ψ, stage 1 8Ψ + 8Ψ/N, stage 2 4Ψ + 12Ψ/N (fp32 gradient shard), stage 3 16Ψ/N.

    python benchmarks/bench_zero.py                       # SmolLM-135M shape, seq 256, micro-batch 2
    python benchmarks/bench_zero.py --preset tiny --seq 64 --steps 2 --warmup 1 --contenders ddp,bunsan3
"""
from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import os
import shlex
import sys
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F

import bunsan
from bunsan.memory.measure import peak_rss_bytes  # VmHWM: ru_maxrss carries the parent's peak across exec
from bunsan.memory.theory import model_state_bytes
from bench_dp import contender_list, GiB, leave_result, machine, make_batches, run_one_by_one, spawn_ranks, timed_steps

WORLD = 2
# contender -> (framework, ZeRO stage of its memory layout, offload to cpu)
CONTENDERS = {"ddp": ("ddp", 0, False), "fsdp2": ("fsdp2", 3, False),
              "ds1": ("deepspeed", 1, False), "ds2": ("deepspeed", 2, False), "ds3": ("deepspeed", 3, False),
              **{f"bunsan{s}": ("bunsan", s, False) for s in range(4)}, "bunsan3o": ("bunsan", 3, True),
              "bunsan3i": ("bunsan", 3, False)}
LR = 1e-4


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1))  # mean over tokens


def make_step(framework: str, stage: int, offload: bool, model: torch.nn.Module, mb: int):
    """A function (x, y) -> loss float doing one optimizer step, plus a function returning bunsan extras."""
    if framework == "bunsan":
        zero: dict = {"stage": stage}
        if offload:
            zero |= {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}
        engine = bunsan.initialize(model, {"train_micro_batch_size_per_gpu": mb, "zero_optimization": zero,
                                           "optimizer": {"type": "AdamW", "params": {"lr": LR}}})

        def extras() -> dict:
            mem = engine.memory_report()
            return {**{k: mem[k] for k in ("model_states", "theory_model_states", "host", "disk")},
                    "comm_step_bytes": sum(v["bytes"] for v in engine.comm_stats()["step"].values())}
        return (lambda x, y: engine.train_batch({"input_ids": x, "labels": y})), extras  # global mean loss

    if framework == "deepspeed":
        import deepspeed  # DS_ACCELERATOR=cpu is set by main() before spawning
        deepspeed.init_distributed(dist_backend="gloo")  # adopts the gloo process group already initialised
        engine, *_ = deepspeed.initialize(model=model, config={
            "train_micro_batch_size_per_gpu": mb, "gradient_accumulation_steps": 1, "steps_per_print": 10 ** 9,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "torch_adam": True}},  # no C++ Adam to build
            "zero_optimization": {"stage": stage}})

        def ds_step(x, y) -> float:
            loss = lm_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            return loss.item()
        return ds_step, dict

    if framework == "ddp":
        net = torch.nn.parallel.DistributedDataParallel(model)
    else:  # fsdp2: shard each transformer block, then the root (embeddings, final norm, head)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (WORLD,))
        for block in model.layers:
            fully_shard(block, mesh=mesh)
        net = fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(net.parameters(), lr=LR)

    def torch_step(x, y) -> float:
        loss = lm_loss(net(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()  # bunsan's train_batch returns a float too: same sync per step
    return torch_step, dict


def _worker(rank: int, contender: str, port: int, a: dict, outdir: str) -> None:
    torch.set_num_threads(1)  # one core per rank
    warnings.filterwarnings("ignore", category=FutureWarning)  # torch's deprecation notes on DeepSpeed's calls
    # The env:// variables torchrun would set; DeepSpeed reads them too (no MPI discovery).
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_SIZE=str(WORLD),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=a["timeout"]))
    framework, stage, offload = CONTENDERS[contender]
    cfg = bunsan.models.get_preset(a["preset"])
    torch.manual_seed(0)  # same initial weights in every contender and rank
    if contender == "bunsan3i":
        with bunsan.zero.Init():
            model = bunsan.models.Llama(cfg)
    else:
        model = bunsan.models.Llama(cfg)
    n_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    batches = make_batches(a["warmup"] + a["steps"], rank, a["micro_batch"], a["seq"], cfg.vocab_size)
    step, extras = make_step(framework, stage, offload, model, a["micro_batch"])

    loss, elapsed = timed_steps(step, batches, a["warmup"], WORLD, average_loss=framework != "bunsan")
    res = {"rank": rank, "tokens_per_s": a["micro_batch"] * a["seq"] * a["steps"] / elapsed,
           "peak_rss": peak_rss_bytes(),
           "loss": loss, "n_params": n_params, **extras()}
    leave_result(outdir, contender, rank, res, WORLD)


def run_contender(contender: str, args: argparse.Namespace) -> list[dict]:
    return spawn_ranks(_worker, contender, WORLD, args)


def failure_reason(e: BaseException) -> str:
    """The last line of a worker's traceback (e.g. 'ValueError: ...'), short enough for a table cell."""
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    reason = lines[-1] if lines else type(e).__name__
    return reason if len(reason) <= 120 else reason[:117] + "..."


def states(psi: int, stage: int) -> float:
    """ZeRO formula: fp32 params, grads (bunsan's stage-2/3 shard is fp32 too), Adam's 8 bytes/param."""
    return model_state_bytes(psi, 4, 8.0, WORLD, stage, grad_shard_bytes=4)["total"]


def build_rows(results: dict[str, list[dict] | str]) -> tuple[list[str], list[list[str]]]:
    header = ["contender", "tokens/s (sum)", "vs DDP", "peak RSS/rank GiB (max)", "ZeRO states GiB (formula)",
              "saving vs DDP GiB (formula)", "saving vs DDP GiB (peak RSS)", "bunsan states GiB (meas/theory)",
              "comm MB/step (meas/theory)", "final loss", "notes"]
    ok = {c: rs for c, rs in results.items() if isinstance(rs, list)}
    tps = {c: sum(r["tokens_per_s"] for r in rs) for c, rs in ok.items()}
    rss = {c: max(r["peak_rss"] for r in rs) for c, rs in ok.items()}
    rows = []
    for c, rs in results.items():
        if not isinstance(rs, list):
            rows.append([c, "FAILED"] + ["-"] * (len(header) - 3) + [rs])
            continue
        r0, (framework, stage, _) = rs[0], CONTENDERS[c]
        psi = r0["n_params"]
        bstates = comm = "-"
        note = ""
        if framework == "bunsan":
            bstates = f"{r0['model_states'] / GiB:.3f} / {r0['theory_model_states'] / GiB:.3f}"
            note = ", ".join(f"{k} {r0[k] / GiB:.3f} GiB" for k in ("host", "disk") if r0[k])
            theory = (3 if stage == 3 else 2) * psi * (WORLD - 1) / WORLD * 4  # fp32 bytes
            comm = f"{r0['comm_step_bytes'] / 1e6:,.2f} / {theory / 1e6:,.2f} ({r0['comm_step_bytes'] / theory:.2f}x)"
        if "round_tokens_per_s" in r0:
            rounds = "rounds " + " / ".join(f"{t:.0f}" for t in r0["round_tokens_per_s"])
            note = f"{note}, {rounds}" if note else rounds
        note = note or "-"
        rows.append([c, f"{tps[c]:,.0f}", f"{tps[c] / tps['ddp']:.2f}" if "ddp" in tps else "n/a",
                     f"{rss[c] / GiB:.3f}", f"{states(psi, stage) / GiB:.3f}",
                     f"{(states(psi, 0) - states(psi, stage)) / GiB:.3f}",
                     f"{(rss['ddp'] - rss[c]) / GiB:.3f}" if "ddp" in rss else "n/a",
                     bstates, comm, f"{r0['loss']:.4f}", note])
    return header, rows


def deepspeed_version() -> str:
    try:
        return importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def write_markdown(path: str, header: list[str], rows: list[list[str]], args: argparse.Namespace) -> None:
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"## ZeRO: bunsan vs DDP, FSDP2 and DeepSpeed ({args.preset}, seq {args.seq}, "
             f"micro-batch {args.micro_batch}, {WORLD} ranks)", "",
             f"- date: {now}", f"- machine: {machine()}, deepspeed {deepspeed_version()}",
             f"- command: `python {shlex.join(sys.argv)}`",
             f"- {args.steps} timed step(s) after {args.warmup} warm-up step(s), {args.rounds} round(s) of the "
             "field (tokens/s: median over rounds); ZeRO states per rank in fp32 "
             "with Adam: stage 0 16Ψ, 1 8Ψ+8Ψ/N, 2 4Ψ+12Ψ/N, 3 16Ψ/N; comm theory 2Ψ(N-1)/N x 4 bytes "
             "(stages 0-2), 3Ψ(N-1)/N x 4 bytes (stage 3)", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in r) + " |" for r in rows]
    with open(path, "a") as f:
        f.write("\n".join(lines) + "\n\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="135m", help="bunsan.models preset (default 135m: SmolLM-135M shape)")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=2, help="rows per rank per step")
    p.add_argument("--steps", type=int, default=5, help="timed steps")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps before the clock starts")
    p.add_argument("--contenders", default=",".join(CONTENDERS), help=f"comma list of {', '.join(CONTENDERS)}")
    p.add_argument("--rounds", type=int, default=1,
                   help="run the whole field this many times, interleaved; tokens/s is each contender's median")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per contender before its ranks are killed")
    p.add_argument("--markdown", metavar="PATH", help="append a markdown section with the table to PATH")
    args = p.parse_args(argv)
    contenders = contender_list(p, args.contenders, CONTENDERS)
    if args.steps < 1 or args.warmup < 0 or args.rounds < 1:
        p.error("--steps and --rounds must be >= 1 and --warmup >= 0")
    bunsan.models.get_preset(args.preset)  # fail fast on a typo, before spawning anything
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # inherited by the spawned ranks
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed on CPU, whatever it would auto-detect

    from rich.console import Console
    from rich.table import Table
    console = Console(width=max(240, Console().width))  # the table is wide; never truncate its cells
    console.print(f"[bold]bench_zero[/]: preset {args.preset}, seq {args.seq}, micro-batch {args.micro_batch}, "
                  f"{args.warmup}+{args.steps} steps, {WORLD} ranks; {machine()}, deepspeed {deepspeed_version()}")
    results = run_one_by_one(contenders, run_contender, args, console, on_failure=failure_reason,
                             rounds=args.rounds)

    header, rows = build_rows(results)
    table = Table(title=f"ZeRO, CPU/gloo, {WORLD} ranks")
    for h in header:
        table.add_column(h, justify="left" if h in ("contender", "notes") else "right", overflow="fold",
                         min_width=30 if h == "notes" else None)
    for r in rows:
        table.add_row(*r)
    console.print(table)
    if args.markdown:
        write_markdown(args.markdown, header, rows, args)
        console.print(f"appended to {args.markdown}")
    return 1 if any(isinstance(rs, str) for rs in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
