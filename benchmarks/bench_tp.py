"""Tensor parallelism on CPU: bunsan TP=2 vs torch DTensor TP=2, DDP, bunsan DP and ZeRO-3.

Every contender trains the same Llama-like model (torch.manual_seed(0) before building) on the same
global batches (batch x seq tokens per step), fp32 AdamW lr 1e-4, in fresh spawned processes with one
thread per rank, one contender after another:

  single        1 process, plain loop on the whole batch; 2 x its tokens/s is "the ceiling" for 2 ranks
  ddp           torch DistributedDataParallel, each rank half the batch
  dtensor_tp    torch DTensor TP (parallelize_module), torchtitan's plan: q/k/v/gate/up ColwiseParallel,
                o/down RowwiseParallel, embedding RowwiseParallel(input_layouts=Replicate()), head
                ColwiseParallel(output_layouts=Shard(-1)) + loss_parallel(); each rank the whole batch
  bunsan_tp     bunsan.initialize(..., tensor_parallel.size 2): vocab-parallel embedding/head/loss
  bunsan_tp_sp  the same with tensor_parallel.sequence_parallel
  bunsan_dp     bunsan ZeRO-0, each rank half the batch (engine.dp_rank)
  bunsan_zero3  bunsan ZeRO-3, each rank half the batch

    python benchmarks/bench_tp.py --markdown benchmarks/RESULTS.md      # ~34M params, 8 x 256 tokens/step
    python benchmarks/bench_tp.py --hidden 128 --layers 2 --vocab 512 --seq 64 --steps 2 --warmup 1
"""
from __future__ import annotations

import argparse
import datetime
import os
import shlex
import sys

import torch
import torch.distributed as dist

import bunsan
from bunsan.memory.measure import peak_rss_bytes  # VmHWM: ru_maxrss carries the parent's peak across exec
from bench_dp import contender_list, GiB, leave_result, machine, make_batches, run_one_by_one, spawn_ranks, timed_steps
from bench_zero import LR, failure_reason, lm_loss

CONTENDERS = {"single": 1, "ddp": 2, "dtensor_tp": 2, "bunsan_tp": 2, "bunsan_tp_sp": 2, "bunsan_dp": 2,
              "bunsan_zero3": 2}
LAYOUT = {"single": "1 process", "ddp": "dp2", "dtensor_tp": "tp2", "bunsan_tp": "tp2", "bunsan_tp_sp": "tp2+sp",
          "bunsan_dp": "dp2", "bunsan_zero3": "dp2 zero3"}
HEADS = 8   # query and key/value heads (plain multi-head attention): TP=2 splits them evenly


def model_config(a: dict):
    """The 'small' preset with the benchmark's shape; intermediate = 43/16 x hidden (small's ratio, 512 -> 1376)."""
    return bunsan.models.build_config("small", hidden_size=a["hidden"], num_hidden_layers=a["layers"],
                                      vocab_size=a["vocab"], intermediate_size=a["hidden"] * 43 // 16,
                                      num_attention_heads=HEADS, num_key_value_heads=HEADS,
                                      max_position_embeddings=max(512, a["seq"]))


def dtensor_tp(model: torch.nn.Module, world: int):
    """torch's tensor parallelism on a 1-D CPU mesh (the gloo group); returns (model, loss context)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, loss_parallel, parallelize_module
    mesh = init_device_mesh("cpu", (world,))
    parallelize_module(model, mesh, {  # vocab-parallel embedding and head, as bunsan's plan and torchtitan do
        "embed_tokens": RowwiseParallel(input_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)})
    for block in model.layers:  # local shards out (use_local_output): attention infers its head count
        parallelize_module(block, mesh, {
            **{f"self_attn.{n}_proj": ColwiseParallel() for n in "qkv"}, "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel()})
    return model, loss_parallel


def make_step(c: str, model: torch.nn.Module, rank: int, world: int, a: dict):
    """(x, y) of the whole global batch -> loss float after one optimizer step; plus an extras() function."""
    if c.startswith("bunsan"):
        conf: dict = {"train_micro_batch_size_per_gpu": a["batch"] if "tp" in c else a["batch"] // world,
                      "optimizer": {"type": "AdamW", "params": {"lr": LR}}}
        if "tp" in c:
            conf["tensor_parallel"] = {"size": world, "sequence_parallel": c == "bunsan_tp_sp"}
        if c == "bunsan_zero3":
            conf["zero_optimization"] = {"stage": 3}
        engine = bunsan.initialize(model, conf)
        mb = conf["train_micro_batch_size_per_gpu"]
        rows = slice(engine.dp_rank * mb, (engine.dp_rank + 1) * mb)

        def extras() -> dict:
            mem = engine.memory_report()
            return {"model_states": mem["model_states"], "theory_model_states": mem["theory_model_states"],
                    "comm_step_bytes": sum(v["bytes"] for v in engine.comm_stats()["step"].values())}
        return (lambda x, y: engine.train_batch({"input_ids": x[rows], "labels": y[rows]})), extras

    loss_ctx, rows = None, slice(None)
    if c == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
        rows = slice(rank * a["batch"] // world, (rank + 1) * a["batch"] // world)
    elif c == "dtensor_tp":
        model, loss_ctx = dtensor_tp(model, world)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)

    def step(x, y) -> float:
        if loss_ctx is None:
            loss = lm_loss(model(x[rows]), y[rows])
            loss.backward()
        else:
            with loss_ctx():  # cross-entropy on vocabulary-sharded logits; backward inside the context
                loss = lm_loss(model(x), y)
                loss.backward()
            loss = loss.full_tensor()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()  # bunsan's train_batch returns a float too: same sync per step
    return step, dict


def _worker(rank: int, c: str, port: int, a: dict, outdir: str) -> None:
    torch.set_num_threads(1)  # one core per rank: 2 ranks on 2 cores, comparable to the 1-thread ceiling
    world = CONTENDERS[c]
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=a["timeout"]))
    cfg = model_config(a)
    torch.manual_seed(0)  # same initial weights in every contender and rank
    model = bunsan.models.Llama(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    batches = make_batches(a["warmup"] + a["steps"], 0, a["batch"], a["seq"], cfg.vocab_size)  # global batches
    step, extras = make_step(c, model, rank, world, a)

    loss, elapsed = timed_steps(step, batches, a["warmup"], world, average_loss=c == "ddp")
    res = {"rank": rank, "elapsed": elapsed, "loss": loss, "n_params": n_params,
           "peak_rss": peak_rss_bytes(), **extras()}
    leave_result(outdir, c, rank, res, world)


def run_contender(c: str, args: argparse.Namespace) -> list[dict]:
    return spawn_ranks(_worker, c, CONTENDERS[c], args)


def comm_theory(c: str, a: argparse.Namespace, psi: int, n: int = 2) -> float:
    """Logical bytes per rank per step. TP (with or without SP): per block the f/g pair around attention and
    the MLP = 2 all-reduces forward + 2 backward of the [b, s, h] fp32 activations, plus the embedding's
    forward and the head input's backward (SP's all-gather + reduce-scatter move the same bytes);
    DP: 2(N-1)/N x fp32 gradients; ZeRO-3: 3(N-1)/N x fp32 parameters."""
    if "tp" in c:
        return (4 * a.layers + 2) * 2 * (n - 1) / n * a.batch * a.seq * a.hidden * 4
    return (3 if c == "bunsan_zero3" else 2) * (n - 1) / n * psi * 4


def build_rows(results: dict[str, list[dict] | str], a: argparse.Namespace) -> tuple[list[str], list[list[str]], str]:
    header = ["contender", "layout", "tokens/s", "vs ceiling", "vs DTensor TP", "peak RSS/rank GiB (max)",
              "model states GiB (meas/theory)", "comm MB/step (meas/theory)", "final loss", "notes"]
    tps = {c: a.batch * a.seq * a.steps / max(r["elapsed"] for r in rs)
           for c, rs in results.items() if isinstance(rs, list)}
    ceiling = 2 * tps["single"] if "single" in tps else None
    peer = tps.get("dtensor_tp")
    rows = []
    for c, rs in results.items():
        if not isinstance(rs, list):
            rows.append([c, LAYOUT[c], "FAILED"] + ["-"] * (len(header) - 4) + [rs])
            continue
        r0 = rs[0]
        states = comm = "-"
        if c.startswith("bunsan"):
            states = f"{r0['model_states'] / GiB:.3f} / {r0['theory_model_states'] / GiB:.3f}"
            th = comm_theory(c, a, r0["n_params"])
            comm = f"{r0['comm_step_bytes'] / 1e6:,.2f} / {th / 1e6:,.2f} ({r0['comm_step_bytes'] / th:.2f}x)"
        rows.append([c, LAYOUT[c], f"{tps[c]:,.0f}", f"{tps[c] / ceiling:.2f}" if ceiling else "n/a",
                     f"{tps[c] / peer:.2f}" if peer else "n/a", f"{max(r['peak_rss'] for r in rs) / GiB:.3f}",
                     states, comm, f"{r0['loss']:.4f}",
                     "rounds " + " / ".join(f"{a.batch * a.seq * a.steps / e:.0f}" for e in r0["round_elapsed"])
                     if "round_elapsed" in r0 else "-"])
    target = ""
    if "bunsan_tp" in tps and ceiling and peer:
        t = tps["bunsan_tp"]
        target = (f"bunsan_tp: {t / ceiling:.2f} of the ceiling (target >= 0.85), {t / peer:.2f} x DTensor TP "
                  f"(target >= 1.00): {'MET' if t / ceiling >= 0.85 and t >= peer else 'NOT MET'}")
    return header, rows, target


def write_markdown(path: str, header, rows, target: str, n_params: int, a: argparse.Namespace) -> None:
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"## Tensor parallelism: bunsan TP=2 vs DTensor TP, DDP, bunsan DP and ZeRO-3 (hidden {a.hidden}, "
             f"{a.layers} layers, vocab {a.vocab}, {n_params:,} params, {a.batch} x {a.seq} tokens/step)", "",
             f"- date: {now}", f"- machine: {machine()}", f"- command: `python {shlex.join(sys.argv)}`",
             f"- {a.steps} timed step(s) after {a.warmup} warm-up step(s), {a.rounds} round(s) of the field "
             "(median); tokens/s = batch x seq x steps / slowest "
             "rank's time; ceiling = 2 x single-process 1-thread tokens/s; comm theory: TP (4L+2) all-reduces of "
             "the fp32 [b, s, h] activations, DP 2Ψ, ZeRO-3 3Ψ (fp32, x (N-1)/N)"]
    lines += [f"- {target}"] if target else []
    lines += ["", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in r) + " |" for r in rows]
    with open(path, "a") as f:
        f.write("\n".join(lines) + "\n\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=512, help=f"hidden size ({HEADS} heads; intermediate 43/16 x)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--batch", type=int, default=8, help="global rows per step (DP ranks take half each)")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=5, help="timed steps")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps before the clock starts")
    p.add_argument("--contenders", default=",".join(CONTENDERS), help=f"comma list of {', '.join(CONTENDERS)}")
    p.add_argument("--rounds", type=int, default=1,
                   help="run the whole field this many times, interleaved; tokens/s is each contender's median")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per contender before its ranks are killed")
    p.add_argument("--markdown", metavar="PATH", help="append a markdown section with the table to PATH")
    args = p.parse_args(argv)
    contenders = contender_list(p, args.contenders, CONTENDERS)
    if args.steps < 1 or args.warmup < 0 or args.rounds < 1 or args.batch % 2:
        p.error("--steps and --rounds must be >= 1, --warmup >= 0 and --batch even (DP ranks take half each)")
    try:
        n_params = model_config(vars(args)).num_params()  # fail fast on a bad shape, before spawning anything
    except ValueError as e:
        p.error(str(e))
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # inherited by the spawned ranks

    from rich.console import Console
    from rich.table import Table
    console = Console(width=max(200, Console().width))  # the table is wide; never truncate its cells
    console.print(f"[bold]bench_tp[/]: hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, "
                  f"{n_params:,} params, {args.batch} x {args.seq} tokens/step, {args.warmup}+{args.steps} steps; "
                  f"{machine()}")
    results = run_one_by_one(contenders, run_contender, args, console, on_failure=failure_reason,
                             rounds=args.rounds)

    header, rows, target = build_rows(results, args)
    table = Table(title=f"tensor parallelism, CPU/gloo, {n_params:,} params")
    for h in header:
        table.add_column(h, justify="left" if h in ("contender", "layout", "notes") else "right", overflow="fold")
    for r in rows:
        table.add_row(*r)
    console.print(table)
    if target:
        console.print(target)
    if args.markdown:
        write_markdown(args.markdown, header, rows, target, n_params, args)
        console.print(f"appended to {args.markdown}")
    return 1 if any(isinstance(rs, str) for rs in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
