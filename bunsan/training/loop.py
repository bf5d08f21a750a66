"""`bunsan train`: the reference Llama on a text corpus, read top to bottom.

config -> process group -> tokens -> model -> engine -> loop (log, eval) -> summary -> final weights.
Runs on every rank that torchrun started; only rank 0 prints and writes.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from bunsan import initialize
from bunsan.checkpoint import store
from bunsan.checkpoint.hf import load_hf_into_engine
from bunsan.config.root import Config
from bunsan.training.data import (TokenBatches, load_tokenizer, load_tokens, make_loader, resolve_paths, unigram_entropy)
from bunsan.comm.process_group import init_distributed
from bunsan.doctor.slow import comm_advice
from bunsan.transforms.lora import merge_lora
from bunsan.training.metrics import Metrics, peak_flops
from bunsan.models import Llama, build_config, flops_per_token
from bunsan.models.hf import read_config
from bunsan.pipeline import write_timeline

# `bunsan train` without a config file: the small preset, sized to learn Python source on a CPU.
MAIN_JOB = {
    "train_micro_batch_size_per_gpu": 4,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.95], "weight_decay": 0.1}},
    "scheduler": {"type": "warmup_cosine", "params": {"warmup_steps": 20, "min_lr_ratio": 0.1}},
    "gradient_clipping": 1.0,
    "steps_per_print": 10,
    "train": {"steps": 200},
}

MEMORY_KEYS = ("params", "grads", "master_weights", "optimizer_states", "buffers", "model_states",
               "theory_model_states", "peak_rss", "rss", "cuda_peak_allocated", "cuda_peak_reserved")


def model_config(cfg: Config, vocab_size: int):
    overrides = {k: v for k, v in cfg.model.model_dump().items() if k != "preset" and v is not None}
    overrides.setdefault("vocab_size", vocab_size)
    mcfg = build_config(cfg.model.preset, **overrides)
    if mcfg.vocab_size < vocab_size:
        raise ValueError(f"model.vocab_size {mcfg.vocab_size} is smaller than the tokenizer's {vocab_size}; "
                         f"set model.vocab_size to at least {vocab_size}")
    if mcfg.max_position_embeddings < cfg.data.seq_len:
        raise ValueError(f"data.seq_len {cfg.data.seq_len} exceeds model.max_position_embeddings "
                         f"{mcfg.max_position_embeddings}; lower data.seq_len or raise max_position_embeddings")
    return mcfg


def gather_memory(engine) -> list[dict]:
    """Every rank's measured memory, on every rank (one small all-gather)."""
    rep = engine.memory_report()
    mine = torch.tensor([float(rep.get(k, 0)) for k in MEMORY_KEYS], dtype=torch.float64, device=engine.device)
    world = engine.mesh.world
    out = torch.zeros(world.size * len(MEMORY_KEYS), dtype=torch.float64, device=engine.device)
    engine.comm.all_gather(out, mine, world)
    rows = out.view(world.size, len(MEMORY_KEYS)).tolist()
    return [{k: int(v) for k, v in zip(MEMORY_KEYS, row) if k in rep} for row in rows]


def save_weights(engine, cfg: Config, mcfg, out_dir: Path, extra: dict) -> Path:
    """Rank 0 writes model.safetensors + config.json into out_dir/final, atomically (tmp dir + rename)."""
    state = engine.consolidated_state_dict()
    if cfg.lora.enabled:   # the plain model's weights: adapters folded in
        state = merge_lora(state, cfg.lora.alpha, cfg.lora.r)
    final = out_dir / "final"
    if engine.mesh.rank == 0:
        tmp = out_dir / f".final.tmp{os.getpid()}"
        tmp.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in state.items()}, str(tmp / "model.safetensors"),
                  metadata={"format": "pt", "producer": "bunsan"})
        meta = {"model": mcfg.to_hf(), "bunsan_config": cfg.to_dict(), **extra}
        (tmp / "config.json").write_text(json.dumps(meta, indent=2))
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        if final.exists():
            old = out_dir / f".final.old{os.getpid()}"
            final.rename(old)
            tmp.rename(final)
            for f in old.iterdir():
                f.unlink()
            old.rmdir()
        else:
            tmp.rename(final)
    return final


def run_training(cfg: Config) -> dict:
    device = init_distributed(cfg.train.backend, timeout_s=cfg.train.timeout_s)
    rank = dist.get_rank()
    torch.manual_seed(cfg.train.seed)
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    files = resolve_paths(cfg.data.paths) if cfg.data.paths else None
    # Rank 0 tokenises (once, cached); the others wait for the cache file to appear and map it.
    tokens = load_tokens(files, tokenizer, cfg.data.cache_dir, cfg.data.max_bytes, build=rank == 0)
    mcfg = model_config(cfg, tokenizer.vocab_size)
    if cfg.train.init_from:       # the Hugging Face model's shape; its weights are loaded once the layout exists
        mcfg = read_config(cfg.train.init_from)
        if mcfg.vocab_size < tokenizer.vocab_size or mcfg.max_position_embeddings < cfg.data.seq_len:
            raise ValueError(f"{cfg.train.init_from} has vocab_size {mcfg.vocab_size} and max_position_embeddings "
                             f"{mcfg.max_position_embeddings}; the data needs at least {tokenizer.vocab_size} and "
                             f"{cfg.data.seq_len}: use its tokenizer (data.tokenizer) or a shorter data.seq_len")
    if cfg.pipeline.stages > 1:   # each rank allocates and initialises only its own stages
        with torch.device("meta"):
            model = Llama(mcfg)
    else:
        model = Llama(mcfg)
    engine = initialize(model, cfg)
    seq = cfg.data.seq_len
    batches = TokenBatches(tokens, seq, engine.train_batch_size, engine.dp_rank, engine.dp_size,
                           seed=cfg.train.seed, val_fraction=cfg.data.val_fraction)
    loader = make_loader(batches, cfg.data.num_workers, cfg.data.pin_memory, cfg.data.prefetch_factor)
    val = val_batches(tokens, cfg, engine)
    if cfg.train.init_from:
        load_hf_into_engine(engine, cfg.train.init_from)
    start, first_loss = resume(engine, cfg, loader)

    out_dir = Path(cfg.train.output_dir)
    metrics = Metrics(out_dir, cfg.train.metrics_file, cfg.train.steps, rank, cfg.tensorboard)
    entropy = unigram_entropy(tokens[: 50_000_000]) if rank == 0 else None
    n_params = mcfg.num_params()   # the whole model's, whatever this rank holds (ZeRO-3, TP, PP)
    fpt = flops_per_token(mcfg, seq)
    peak = peak_flops(device)
    tokens_per_step = engine.train_batch_size * seq
    if rank == 0:
        metrics.console.print(
            f"[bold]bunsan train[/]: {cfg.model.preset} Llama, {n_params / 1e6:.2f}M params, "
            f"{dist.get_world_size()} x {device.type}, dp={engine.dp_size}, zero={cfg.zero_optimization.stage}, "
            f"batch {engine.train_batch_size} x {seq} tokens (micro {engine.micro_batch} x accum "
            f"{engine.grad_accum}), {len(tokens):,} corpus tokens, unigram entropy {entropy:.3f} nats")
    losses, t_start, t_last, steps_timed = [], None, time.perf_counter(), 0
    wait_start = wait_after_first = 0.0      # comm waits from the first timed step on (the doctor's share)
    it = iter(loader)
    for step in range(start + 1, cfg.train.steps + 1):
        batch = next(it)
        loss = engine.train_batch(batch)
        wait_after_first = engine.comm.wait_s if step == start + 1 else wait_after_first
        losses.append(loss)
        first_loss = loss if first_loss is None else first_loss
        save_every = cfg.checkpoint.save_interval
        if cfg.checkpoint.dir and (step == cfg.train.steps or save_every and step % save_every == 0):
            engine.save_checkpoint(cfg.checkpoint.dir, client_state={"data": loader.state_dict(),
                                                                     "first_loss": first_loss})
        now = time.perf_counter()
        if step == start + 2:  # the first step pays for warm-up (allocation, compile): time from the next on
            t_start, steps_timed = t_last, 0
            wait_start = wait_after_first
        steps_timed += 1 if t_start is not None else 0
        t_last = now
        if step % cfg.steps_per_print == 0 or step == cfg.train.steps or step == 1:
            tps = tokens_per_step * steps_timed / max(now - t_start, 1e-9) if t_start is not None else 0.0
            record = {"step": step, "loss": loss, "lr": engine.lr, "grad_norm": engine.last_grad_norm,
                      "loss_scale": engine.loss_scale, "tokens_per_s": tps,
                      "mfu": tps * fpt / (peak * dist.get_world_size()) if peak else None,
                      "comm_bytes": engine.comm_stats()["step_bytes"]}
            if cfg.train.log_memory:
                record["memory"] = gather_memory(engine)
            metrics.log(record)
        if val is not None and cfg.train.eval_interval and step % cfg.train.eval_interval == 0:
            metrics.log({"step": step, "val_loss": evaluate(engine, val, cfg.train.eval_batches)})
    elapsed = time.perf_counter() - (t_start or t_last)
    waited = engine.comm.wait_s - wait_start        # over the same steps as `elapsed`
    tps = tokens_per_step * max(steps_timed, 1) / max(elapsed, 1e-9)
    memory = gather_memory(engine)
    timeline = engine.pipeline_timeline()     # collective over the pipeline group
    if timeline is not None and rank == 0:
        t = write_timeline(timeline, engine.pipe, out_dir)
        extra_timeline = {"pipeline bubble": f"{t['bubble']:.3f} measured, {t['theory']:.3f} theory, "
                                             f"{t['simulated']:.3f} simulated with the measured stage times "
                                             f"({t['schedule']}; {out_dir / 'timeline.png'})"}
    else:
        extra_timeline = {}
    if not losses:    # resumed a finished run: nothing left to train
        losses = [float("nan")]
    final = save_weights(engine, cfg, mcfg, out_dir, {"steps": cfg.train.steps, "final_loss": losses[-1]})
    mfu = tps * fpt / (peak * dist.get_world_size()) if peak else None
    tail = losses[-10:]
    extra = {"loss, mean of last steps": f"{sum(tail) / len(tail):.4f} (last {len(tail)} steps)", **extra_timeline}
    val_loss = evaluate(engine, val, cfg.train.eval_batches) if val is not None else None
    if val_loss is not None:
        extra["held-out loss"] = f"{val_loss:.4f} ({cfg.train.eval_batches} validation batches)"
        metrics.log({"step": cfg.train.steps, "val_loss": val_loss})
    if t_start is not None:       # (a run of one step, or one resumed at its end, has no timed steps)
        share, advice = comm_advice(cfg, waited, max(elapsed, 1e-9), dist.get_world_size(), mcfg, device.type)
        extra["waiting for communication"] = f"{share:.0%} of step time (rank {rank})" + (
            f"\n{advice}" if advice else "")
    extra.update({"weights": str(final / "model.safetensors"), "metrics": str(out_dir / cfg.train.metrics_file)})
    metrics.summary(first_loss, losses[-1], entropy, tps, mfu, memory, extra)
    metrics.close()
    return {"first_loss": first_loss, "last_loss": losses[-1], "resumed_from": start, "val_loss": val_loss,
            "entropy": entropy, "tokens_per_s": tps, "memory": memory, "final": str(final)}


def resume(engine, cfg: Config, loader) -> tuple[int, float | None]:
    """(steps already done, first loss of the run) from the newest whole checkpoint in checkpoint.dir."""
    ck = cfg.checkpoint
    if not (ck.dir and ck.resume and store.candidates(Path(ck.dir), None)):
        return 0, None
    path, client = engine.load_checkpoint(ck.dir)
    loader.load_state_dict(client["data"])
    if engine.mesh.rank == 0:
        print(f"bunsan train: resumed from {path} at step {engine.global_step}", flush=True)
    return engine.global_step, client.get("first_loss")


def val_batches(tokens, cfg: Config, engine) -> TokenBatches | None:
    """The held-out split, or None when there is none or it is smaller than one global batch."""
    if not cfg.data.val_fraction:
        return None
    try:
        return TokenBatches(tokens, cfg.data.seq_len, engine.train_batch_size, engine.dp_rank, engine.dp_size,
                            seed=cfg.train.seed, split="val", val_fraction=cfg.data.val_fraction)
    except ValueError:
        return None


def evaluate(engine, val: TokenBatches, n_batches: int) -> float:
    n = min(n_batches, max(1, val.n_windows // val.global_batch))
    return sum(engine.eval_batch(val.batch_at(i * val.global_batch)) for i in range(n)) / n
