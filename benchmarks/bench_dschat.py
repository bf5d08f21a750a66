"""DeepSpeed-Chat's own training scripts, steps 1-3, run with DeepSpeed and with bunsan side by side.

The scripts are DeepSpeedExamples' (applications/DeepSpeed-Chat), from a checkout you give; nothing of them is
copied into bunsan. Each side gets its own copy of the application; on bunsan's, one line is added to each
step's main.py before its `import deepspeed`:

    import bunsan.deepspeed.as_deepspeed     # from here on `import deepspeed` is bunsan.deepspeed

and nothing else changes (dschat's package keeps its own `import deepspeed` lines). Both sides train a tiny
random OPT (2 layers, hidden 64, a BPE vocabulary of 320 trained on the data) on local JSON preference data in
DeepSpeed-Chat's `local/jsonfile` layout, 2 CPU ranks (gloo, DS_ACCELERATOR=cpu), with the same seed.

    python benchmarks/bench_dschat.py --examples ~/DeepSpeedExamples                       # every case
    python benchmarks/bench_dschat.py --examples DIR --cases step1-z3-bf16 --json out.json --markdown out.md

Recorded per case and side: the curve each step prints (step 1: each rank's loss per step; step 2: the reward
model's scores and accuracy every 10 steps and the epoch's mean loss; step 3: actor and critic losses per PPO
step), the largest relative gap to DeepSpeed's, end-to-end tokens/s (every token of every step over the whole
process's wall time, start-up included) and each rank's peak resident memory (/usr/bin/time). DeepSpeed-Chat
offers fp16 and bf16 only, so there is no fp32 case: the gaps are named in RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_dp import machine
from dschat_fixture import write_critic, write_data, write_model

SWITCH = "import bunsan.deepspeed.as_deepspeed  # bunsan: `import deepspeed` is bunsan.deepspeed\n"
STEPS = {1: "step1_supervised_finetuning", 2: "step2_reward_model_finetuning", 3: "step3_rlhf_finetuning"}
MICRO, SEQ1, SEQ2, PROMPT3, ANSWER3 = 4, 32, 48, 16, 16


def step_args(step: int, fix: Path) -> list[str]:
    common = ["--data_path", "local/jsonfile", "--num_train_epochs", "1", "--seed", "1"]
    if step == 1:
        return common + ["--model_name_or_path", str(fix / "opt"), "--data_split", "10,0,0",
                         "--per_device_train_batch_size", str(MICRO), "--per_device_eval_batch_size", str(MICRO),
                         "--max_seq_len", str(SEQ1), "--learning_rate", "1e-3", "--print_loss"]
    if step == 2:
        return common + ["--model_name_or_path", str(fix / "opt"), "--data_split", "0,10,0",
                         "--per_device_train_batch_size", str(MICRO), "--per_device_eval_batch_size", str(MICRO),
                         "--max_seq_len", str(SEQ2), "--learning_rate", "1e-3", "--num_padding_at_beginning", "0",
                         "--eval_interval", "10", "--eval_iters", "4"]
    return common + ["--data_split", "0,0,10", "--actor_model_name_or_path", str(fix / "opt"),
                     "--critic_model_name_or_path", str(fix / "critic"), "--num_padding_at_beginning", "0",
                     "--per_device_generation_batch_size", str(MICRO), "--per_device_training_batch_size", str(MICRO),
                     "--generation_batches", "1", "--ppo_epochs", "1", "--max_prompt_seq_len", str(PROMPT3),
                     "--max_answer_seq_len", str(ANSWER3), "--actor_learning_rate", "1e-4",
                     "--critic_learning_rate", "1e-4", "--deepspeed"]


# DeepSpeed-Chat's own LoRA (dschat/utils/module/lora.py) on the actor's and the critic's decoder layers
LORA = ["--actor_lora_dim", "4", "--actor_lora_module_name", "decoder.layers.", "--critic_lora_dim", "4",
        "--critic_lora_module_name", "decoder.layers.", "--only_optimize_lora"]


def case_args(step: int, stage: int, dtype: str, offload: bool, hybrid: bool, lora: bool = False) -> list[str]:
    zero = ["--zero_stage", str(stage)] if step < 3 else ["--actor_zero_stage", str(stage), "--critic_zero_stage",
                                                           str(stage)]
    return zero + ["--dtype", dtype] + (["--offload"] if offload else []) + \
        (["--enable_hybrid_engine"] if hybrid else []) + (LORA if lora else [])


def _name(step, stage, dtype, offload, hybrid, lora) -> str:
    return f"step{step}-z{stage}-{dtype}" + "-offload" * offload + "-hybrid" * hybrid + "-lora" * lora


# name -> (step, stage, dtype, offload, hybrid engine, LoRA). Step 3 at ZeRO-2 with the hybrid engine and
# --offload needs LoRA: DeepSpeed-Chat's main.py refuses that combination itself ("training instability").
_ALL = [(s, z, d, o, False, False) for s in (1, 2) for z in range(4) for d in ("bf16", "fp16") for o in (False, True)]
_ALL += [(3, z, d, o, h, False) for z in range(4) for d in ("bf16", "fp16") for o in (False, True)
         for h in (False, True) if not (z == 2 and o and h)]
_ALL += [(3, z, "bf16", o, h, True) for z in (0, 2, 3) for o in (False, True) for h in (False, True)]
CASES = {_name(*case): case for case in _ALL}


def prepare(examples: Path, work: Path) -> dict[str, Path]:
    """Both sides' copies of the application and the fixture; bunsan's copy gets the one import line."""
    source = examples / "applications" / "DeepSpeed-Chat"
    if not (source / "dschat").is_dir():
        raise SystemExit(f"{source} is not DeepSpeed-Chat (no dschat/): pass --examples DeepSpeedExamples' root")
    roots = {}
    for side in ("deepspeed", "bunsan"):
        root = work / side / "DeepSpeed-Chat"
        if root.exists():
            shutil.rmtree(root)
        shutil.copytree(source, root, ignore=shutil.ignore_patterns("assets", "*.png", "*.gif", "*.mp4"))
        write_data(root)
        if side == "bunsan":
            for step in STEPS.values():
                main = root / "training" / step / "main.py"
                text = main.read_text()
                main.write_text(text.replace("\nimport deepspeed\n", "\n" + SWITCH + "import deepspeed\n", 1))
        roots[side] = root
    fix = work / "fixture"
    if not (fix / "critic" / "pytorch_model.bin").exists():
        write_model(fix / "opt", roots["deepspeed"])
        write_critic(fix / "opt", fix / "critic")
    return roots | {"fixture": fix}


def run(root: Path, step: int, args: list[str], logs: Path, port: int, timeout: int) -> dict:
    """One step on 2 ranks; each rank's output and peak RSS to its own file (lines stay whole)."""
    logs.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": str(root), "LOGS": str(logs), "TRANSFORMERS_VERBOSITY": "error",
           "MAX_JOBS": os.environ.get("MAX_JOBS", "1")}   # DeepSpeed's first run compiles its CPU ops: not 2 x N jobs
    rank_cmd = (f'exec /usr/bin/time -f %M -o "$LOGS/rss$LOCAL_RANK" {sys.executable} main.py "$@" '
                '--local_rank $LOCAL_RANK > "$LOGS/rank$LOCAL_RANK.log" 2>&1')
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
           "--no-python", "bash", "-c", rank_cmd, "_", *args]
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, check=False, cwd=root / "training" / STEPS[step], env=env, capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired:   # (the ranks are killed with torchrun) recorded, and the next case runs
        proc = subprocess.CompletedProcess(cmd, -9, "", f"error: timed out after {timeout} s")
    wall = time.perf_counter() - start
    texts = [(logs / f"rank{r}.log").read_text() if (logs / f"rank{r}.log").exists() else "" for r in range(2)]
    rss = [_peak_rss(logs / f"rss{r}") for r in range(2)]
    out = {"rc": proc.returncode, "wall_s": round(wall, 1), "peak_rss_bytes": rss, "curve": curve(step, texts)}
    if proc.returncode:
        out["error"] = next((line for t in texts for line in reversed(t.splitlines())
                             if re.search(r"Error|error:", line)), proc.stderr.strip().splitlines()[-1:])
    return out


def _peak_rss(path: Path) -> int | None:
    """/usr/bin/time's maximum resident set (KiB) in bytes; None when the rank left none (it was killed)."""
    words = path.read_text().split() if path.exists() else []
    return int(words[-1]) * 1024 if words and words[-1].isdigit() else None


def curve(step: int, texts: list[str]) -> dict[str, list[float]]:
    number = r"(-?[\d.]+(?:e-?\d+)?)"
    if step == 1:
        return {f"loss_rank{r}": [float(v) for v in re.findall(r"loss = " + number, t)] for r, t in enumerate(texts)}
    if step == 2:
        t = texts[0]
        return {"chosen": [float(v) for v in re.findall(r"c_scores: " + number, t)],
                "rejected": [float(v) for v in re.findall(r"r_scores: " + number, t)],
                "acc": [float(v) for v in re.findall(r"acc: " + number, t)],
                "epoch_loss": [float(v) for v in re.findall(r"with loss " + number, t)]}
    t = texts[0]
    return {"actor_loss": [float(v) for v in re.findall(r"Actor Loss: " + number, t)],
            "critic_loss": [float(v) for v in re.findall(r"Critic Loss: " + number, t)],
            "reward": [float(v) for v in re.findall(r"Average reward score: " + number, t)]}


def tokens(step: int, result: dict) -> int:
    if step == 1:
        return len(result["curve"]["loss_rank0"]) * 2 * MICRO * SEQ1
    if step == 2:
        return 320 * 2 * SEQ2                         # chosen and rejected of every training record
    return len(result["curve"]["actor_loss"]) * 2 * MICRO * (PROMPT3 + ANSWER3)


def gap(ours: dict, theirs: dict) -> float | None:
    worst = 0.0
    for key, ref in theirs.items():
        got = ours.get(key, [])
        if len(got) != len(ref):
            return None
        worst = max([worst] + [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(got, ref)])
    return worst


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--examples", type=Path, required=True, help="a DeepSpeedExamples checkout")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--sides", default="deepspeed,bunsan")
    ap.add_argument("--work", type=Path, default=Path("/tmp/bench-dschat"))
    ap.add_argument("--timeout", type=int, default=900)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--markdown", type=Path)
    args = ap.parse_args()
    roots = prepare(args.examples, args.work)
    results, port = {}, 29800
    for name in args.cases.split(","):
        step, stage, dtype, offload, hybrid, lora = CASES[name]
        for side in args.sides.split(","):
            port += 1
            cmd = step_args(step, roots["fixture"]) + case_args(step, stage, dtype, offload, hybrid, lora) + \
                ["--data_output_path", str(args.work / side / f"cache-{name}")]
            res = run(roots[side], step, cmd, args.work / side / "logs" / name, port, args.timeout)
            res["tokens_per_s"] = round(tokens(step, res) / res["wall_s"], 1) if res["rc"] == 0 else None
            results.setdefault(name, {})[side] = res
            print(f"{name:28s} {side:9s} rc={res['rc']} {res['wall_s']:6.1f}s {res.get('error', '')}", flush=True)
        sides = results[name]
        if "deepspeed" in sides and "bunsan" in sides and sides["deepspeed"]["rc"] == sides["bunsan"]["rc"] == 0:
            sides["gap"] = gap(sides["bunsan"]["curve"], sides["deepspeed"]["curve"])
    meta = {"date": time.strftime("%Y-%m-%d"), "machine": machine(), "command": " ".join(sys.argv)}
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    if args.markdown:
        args.markdown.write_text(markdown(meta, results))
    return 0


def markdown(meta: dict, results: dict) -> str:
    def side(r):
        if r is None:
            return "-", "-", "-"
        if r["rc"]:
            return f"fails: {str(r.get('error'))[:60]}", "-", "-"
        rss = [x for x in r["peak_rss_bytes"] if x]
        return "runs", f"{r['tokens_per_s']:.0f}", f"{max(rss) / 2**20:.0f}" if rss else "-"
    rows = ["| case | DeepSpeed | tok/s | peak RSS MiB | bunsan | tok/s | peak RSS MiB | largest gap |",
            "|---|---|---|---|---|---|---|---|"]
    for name, sides in results.items():
        g = sides.get("gap")
        rows.append(f"| {name} | " + " | ".join(side(sides.get("deepspeed"))) + " | " +
                    " | ".join(side(sides.get("bunsan"))) + f" | {'-' if g is None else f'{g:.2e}'} |")
    return f"- date: {meta['date']}\n- machine: {meta['machine']}\n- command: `{meta['command']}`\n\n" + \
        "\n".join(rows) + "\n"


if __name__ == "__main__":
    sys.exit(main())
