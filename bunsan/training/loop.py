"""`bunsan train`: bunsan's Llama (or, --init-from, any transformers causal LM) on a corpus or records, read
top to bottom.

config -> process group -> tokens -> model -> engine -> loop (log, eval) -> summary -> final weights.
Runs on every rank that torchrun started; only rank 0 prints and writes.
"""

from __future__ import annotations

import os
import shutil
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import SafetensorError

from bunsan import initialize
from bunsan.checkpoint import check_shared, store
from bunsan.checkpoint.store import CheckpointError
from bunsan.checkpoint.adapter import write_adapter
from bunsan.checkpoint.final import tokenizer_files, write_final
from bunsan.checkpoint.hf import load_hf_into_engine
from bunsan.config.deepspeed_keys import IgnoredKeyWarning
from bunsan.config.root import Config
from bunsan.context_parallel import check_length
from bunsan.training.data import TokenBatches, make_loader, unigram_entropy
from bunsan.engine.batch import keyword_inputs
from bunsan.training.freeze import freeze
from bunsan.training.hf_model import HFShape, is_other_architecture, load_hf_model, use_shift_labels
from bunsan.training.media_batches import takes_inputs
from bunsan.training.preference_data import reference_logps
from bunsan.training.sources import held_out_batches, load_source, tokenizer_folder, train_batches
from bunsan.comm.process_group import init_distributed
from bunsan.doctor.slow import comm_advice
from bunsan.transforms.lora import merge_lora
from bunsan.training.metrics import Metrics, peak_flops
from bunsan.models import Llama, LlamaConfig, build_config, flops_per_token
from bunsan.models.hf import check_llama_dir, read_config
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
    if cfg.context_parallel.size > 1:
        check_length(cfg.data.seq_len, cfg.context_parallel.size)
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
    """Rank 0 writes the model as a Hugging Face directory into out_dir/final and, as lora.save says, the LoRA
    adapters as peft's into out_dir/adapter, each atomically (tmp dir + rename); the folder written last."""
    state = engine.consolidated_state_dict()
    save = cfg.lora.save if cfg.lora.enabled else "merged"
    written = out_dir / "final"
    if save in ("adapter", "both"):
        written = out_dir / "adapter"
        if engine.mesh.rank == 0:
            generation = Path(cfg.train.init_from) / "generation_config.json"     # (its end-of-turn ids)
            write_adapter(written, state, cfg.lora, cfg.train.init_from, isinstance(mcfg, LlamaConfig),
                          tokenizer_files(tokenizer_folder(cfg)) + ([(generation, generation.name)]
                                                                     if generation.is_file() else []))
    if save == "adapter":
        return written
    if cfg.lora.enabled:   # the plain model's weights: adapters folded in
        state = merge_lora(state, cfg.lora.alpha, cfg.lora.r)
    final = out_dir / "final"
    if engine.mesh.rank == 0:
        tmp = out_dir / f".final.tmp{os.getpid()}"
        try:
            write_final(tmp, final, state, mcfg, {"bunsan_config": cfg.to_dict(), **extra}, tokenizer_folder(cfg),
                        cfg.train.init_from)
        except (OSError, SafetensorError) as e:
            shutil.rmtree(tmp, ignore_errors=True)
            need = sum(v.numel() * v.element_size() for v in state.values())
            raise CheckpointError(f"writing the final weights to {final} failed ({type(e).__name__}: {e}); they "
                                  f"need {need:,} bytes; nothing partial was left: free space or pass another "
                                  "--out") from None
    return final


def run_training(cfg: Config) -> dict:
    """Train as `cfg` says, on this rank: set up, resume, the steps, the end-of-run outputs (a summary dict)."""
    run = set_up(cfg)
    start, first_loss = resume(run.engine, cfg, run.loader)
    meter = open_meter(run, start)
    clock = StepClock(start)
    losses, first_loss = train_steps(run, meter, clock, first_loss)
    return finish(run, meter, clock, losses, first_loss)


@dataclass
class Run:
    """What this rank trains with: its corpus, the model's shape, the engine and the batches."""
    cfg: Config
    device: torch.device
    rank: int
    tokens: Any                       # the whole corpus's token ids
    mcfg: LlamaConfig | HFShape       # bunsan's Llama, or a transformers model's shape (--init-from)
    engine: Any
    loader: Any                       # the training batches (resumable: state_dict/load_state_dict)
    val: TokenBatches | None          # the held-out split


def set_up(cfg: Config) -> Run:
    """Process group, tokens, model and engine, the batches; a Hugging Face model's weights (train.init_from)."""
    device = init_distributed(cfg.train.backend, timeout_s=cfg.train.timeout_s)
    rank = dist.get_rank()
    torch.manual_seed(cfg.train.seed)
    tokenizer, source = load_source(cfg, rank)
    tokens = source if cfg.data.format == "text" else source.ids.reshape(-1)
    other = bool(cfg.train.init_from) and is_other_architecture(cfg.train.init_from)
    multimodal = getattr(source, "media", None) is not None      # chat records through a processor (media_chat.py)
    if multimodal and not other:
        raise ValueError(f"chat records rendered by {tokenizer_folder(cfg)}'s processor (images or audio) train a "
                         "vision- or audio-language model: set train.init_from to its directory, not "
                         f"{cfg.train.init_from or 'the model section (a text Llama)'}")
    if other:                     # a transformers model with its weights (hf_model.py)
        model, mcfg = load_hf_model(cfg.train.init_from, cfg, tokenizer.vocab_size, multimodal)
    else:
        mcfg = run_model_config(cfg, tokenizer.vocab_size)
        mcfg.to_hf()      # the final weights' form (a MoE block Mixtral cannot hold): refused now, not at the end
        if cfg.pipeline.stages > 1:   # each rank allocates and initialises only its own stages
            with torch.device("meta"):
                model = Llama(mcfg)
        else:
            model = Llama(mcfg)
    freeze(model, cfg.train.freeze, adapters=cfg.lora.enabled)    # (before the engine sees which ones train)
    with warnings.catch_warnings():   # bunsan train does write TensorBoard scalars (training/metrics.py)
        warnings.filterwarnings("ignore", "config key tensorboard.enabled", IgnoredKeyWarning)
        engine = initialize(model, cfg)
    if cfg.checkpoint.dir:
        check_shared(engine, cfg.checkpoint.dir)     # (now, not at the first save hours later)
    if cfg.train.init_from and not other:
        load_hf_into_engine(engine, cfg.train.init_from)
    if cfg.train.objective == "dpo" and cfg.dpo.reference == "initial":
        # the model before any step, here before a resume loads its checkpoint: a resumed run's reference too
        source.ref_logps = reference_logps(engine, source, "shift_labels" if other else "labels")
    batches = train_batches(source, cfg, engine)
    val = held_out_batches(source, cfg, engine)
    if other:
        use_shift_labels(batches, val)
        takes_inputs(keyword_inputs(model), batches, val)
    loader = make_loader(batches, cfg.data.num_workers, cfg.data.pin_memory, cfg.data.prefetch_factor)
    return Run(cfg, device, rank, tokens, mcfg, engine, loader, val)


def run_model_config(cfg: Config, vocab_size: int):
    """The model's shape: the config's, or with train.init_from the Hugging Face model's (its weights are
    loaded once the layout exists)."""
    mcfg = model_config(cfg, vocab_size)
    if not cfg.train.init_from:
        return mcfg
    mcfg = read_config(cfg.train.init_from)
    check_llama_dir(cfg.train.init_from, mcfg)     # its weights are exactly a Llama of its config.json
    if mcfg.vocab_size < vocab_size or mcfg.max_position_embeddings < cfg.data.seq_len:
        raise ValueError(f"{cfg.train.init_from} has vocab_size {mcfg.vocab_size} and max_position_embeddings "
                         f"{mcfg.max_position_embeddings}; the data needs at least {vocab_size} and "
                         f"{cfg.data.seq_len}: use its tokenizer (data.tokenizer) or a shorter data.seq_len")
    return mcfg


@dataclass
class Meter:
    """What the run's log lines and summary measure against."""
    out_dir: Path
    metrics: Metrics
    entropy: float | None             # the corpus's unigram entropy (rank 0)
    flops_per_token: float
    peak: float | None                # the device's peak FLOP/s, when known
    tokens_per_step: int

    def mfu(self, tokens_per_s: float) -> float | None:
        return tokens_per_s * self.flops_per_token / (self.peak * dist.get_world_size()) if self.peak else None


def open_meter(run: Run, resumed_at: int = 0) -> Meter:
    """The metrics file (a resumed run continues its history) and console; rank 0 prints the first line."""
    cfg, engine, seq = run.cfg, run.engine, run.cfg.data.seq_len
    out_dir = Path(cfg.train.output_dir)
    metrics = Metrics(out_dir, cfg.train.metrics_file, cfg.train.steps, run.rank, cfg.tensorboard,
                      resumed_at=resumed_at)
    entropy = unigram_entropy(run.tokens[: 50_000_000]) if run.rank == 0 else None
    n_params = run.mcfg.num_params()   # the whole model's, whatever this rank holds (ZeRO-3, TP, PP)
    meter = Meter(out_dir, metrics, entropy, flops_per_token(run.mcfg, seq), peak_flops(run.device),
                  engine.train_batch_size * seq)
    if run.rank == 0:
        metrics.console.print(
            f"[bold]bunsan train[/]: {model_name(run)}, {n_params / 1e6:.2f}M params, "
            f"{dist.get_world_size()} x {run.device.type}, dp={engine.dp_size}"
            + (f", cp={engine.cp_size}" if engine.cp_size > 1 else "") + f", zero={cfg.zero_optimization.stage}, "
            f"batch {engine.train_batch_size} x {seq} tokens (micro {engine.micro_batch} x accum "
            f"{engine.grad_accum}), {len(run.tokens):,} corpus tokens, unigram entropy {entropy:.3f} nats")
    return meter


def model_name(run: Run) -> str:
    if isinstance(run.mcfg, HFShape):
        return f"{run.mcfg.hf_config.get('model_type')} from {run.cfg.train.init_from}"
    return f"{run.cfg.model.preset} Llama"


@dataclass
class StepClock:
    """Times the steps from the second of this run on (the first pays for warm-up: allocation, compile),
    and the communication waits over the same steps (the doctor's share)."""
    start: int                        # steps done before this run (resumed)
    t_last: float = field(default_factory=time.perf_counter)
    t_start: float | None = None
    steps_timed: int = 0
    wait_start: float = 0.0
    wait_after_first: float = 0.0

    def tick(self, step: int) -> float:
        """Step `step` is done (the caller has put the waits after the first in wait_after_first): the time now."""
        now = time.perf_counter()
        if step == self.start + 2:
            self.t_start, self.steps_timed = self.t_last, 0
            self.wait_start = self.wait_after_first
        self.steps_timed += 1 if self.t_start is not None else 0
        self.t_last = now
        return now

    def tokens_per_s(self, tokens_per_step: int, now: float) -> float:
        if self.t_start is None:
            return 0.0
        return tokens_per_step * self.steps_timed / max(now - self.t_start, 1e-9)


def train_steps(run: Run, meter: Meter, clock: StepClock, first_loss: float | None) -> tuple[list, float | None]:
    """The steps left after clock.start: train, checkpoint, log, evaluate. (losses, first loss of the run)."""
    cfg, engine = run.cfg, run.engine
    losses = []
    it = iter(run.loader)
    for step in range(clock.start + 1, cfg.train.steps + 1):
        loss = engine.train_batch(next(it))
        if step == clock.start + 1:
            clock.wait_after_first = engine.comm.wait_s
        losses.append(loss)
        first_loss = loss if first_loss is None else first_loss
        save_every = cfg.checkpoint.save_interval
        if cfg.checkpoint.dir and (step == cfg.train.steps or save_every and step % save_every == 0):
            engine.save_checkpoint(cfg.checkpoint.dir, client_state={"data": run.loader.state_dict(),
                                                                     "first_loss": first_loss})
        now = clock.tick(step)
        if step % cfg.steps_per_print == 0 or step == cfg.train.steps or step == 1:
            log_step(run, meter, step, loss, clock.tokens_per_s(meter.tokens_per_step, now))
        if run.val is not None and cfg.train.eval_interval and step % cfg.train.eval_interval == 0:
            meter.metrics.log({"step": step, "val_loss": evaluate(engine, run.val, cfg.train.eval_batches)})
    return losses, first_loss


def log_step(run: Run, meter: Meter, step: int, loss: float, tokens_per_s: float) -> None:
    engine = run.engine
    record = {"step": step, "loss": loss, "lr": engine.lr, "grad_norm": engine.last_grad_norm,
              "loss_scale": engine.loss_scale, "tokens_per_s": tokens_per_s, "mfu": meter.mfu(tokens_per_s),
              "comm_bytes": engine.comm_stats()["step_bytes"], **engine.moe.metrics()}
    if run.cfg.train.log_memory:
        record["memory"] = gather_memory(engine)
    meter.metrics.log(record)


def finish(run: Run, meter: Meter, clock: StepClock, losses: list, first_loss: float | None) -> dict:
    """End of the run: measured memory, the pipeline timeline, the final weights, held-out loss, the summary."""
    cfg, engine, out_dir = run.cfg, run.engine, meter.out_dir
    elapsed = time.perf_counter() - (clock.t_start or clock.t_last)
    waited = engine.comm.wait_s - clock.wait_start        # over the same steps as `elapsed`
    tps = meter.tokens_per_step * max(clock.steps_timed, 1) / max(elapsed, 1e-9)
    memory = gather_memory(engine)
    extra_timeline = timeline_summary(run, out_dir)     # collective over the pipeline group
    if not losses:    # resumed a finished run: nothing left to train
        losses = [float("nan")]
    final = save_weights(engine, cfg, run.mcfg, out_dir, {"steps": cfg.train.steps, "final_loss": losses[-1]})
    mfu = meter.mfu(tps)
    tail = losses[-10:]
    extra = {"loss, mean of last steps": f"{sum(tail) / len(tail):.4f} (last {len(tail)} steps)", **extra_timeline}
    val_loss = evaluate(engine, run.val, cfg.train.eval_batches) if run.val is not None else None
    if val_loss is not None:
        extra["held-out loss"] = f"{val_loss:.4f} ({cfg.train.eval_batches} validation batches)"
        meter.metrics.log({"step": cfg.train.steps, "val_loss": val_loss})
    if clock.t_start is not None:       # (a run of one step, or one resumed at its end, has no timed steps)
        share, advice = comm_advice(cfg, waited, max(elapsed, 1e-9), dist.get_world_size(),
                                    None if isinstance(run.mcfg, HFShape) else run.mcfg,
                                    run.device.type)
        extra["waiting for communication"] = f"{share:.0%} of step time (rank {run.rank})" + (
            f"\n{advice}" if advice else "")
    extra.update({"weights": str(final), "metrics": str(out_dir / cfg.train.metrics_file)})
    meter.metrics.summary(first_loss, losses[-1], meter.entropy, tps, mfu, memory, extra)
    meter.metrics.close()
    return {"first_loss": first_loss, "last_loss": losses[-1], "resumed_from": clock.start, "val_loss": val_loss,
            "entropy": meter.entropy, "tokens_per_s": tps, "memory": memory, "final": str(final)}


def timeline_summary(run: Run, out_dir: Path) -> dict:
    """Under PP, rank 0 draws the measured timeline and says its bubble (collective over the pipeline group)."""
    timeline = run.engine.pipeline_timeline()
    if timeline is None or run.rank != 0:
        return {}
    t = write_timeline(timeline, run.engine.pipe, out_dir)
    return {"pipeline bubble": f"{t['bubble']:.3f} measured, {t['theory']:.3f} theory, "
                               f"{t['simulated']:.3f} simulated with the measured stage times "
                               f"({t['schedule']}; {out_dir / 'timeline.png'})"}


def resume(engine, cfg: Config, loader) -> tuple[int, float | None]:
    """(steps already done, first loss of the run) from the newest whole checkpoint in checkpoint.dir."""
    ck = cfg.checkpoint
    if not (ck.dir and ck.resume and store.candidates(Path(ck.dir), None)):
        return 0, None
    path, client = engine.load_checkpoint(ck.dir, load_optimizer_states=ck.load_optimizer_states)
    loader.load_state_dict(client["data"])
    if engine.mesh.rank == 0:
        print(f"bunsan train: resumed from {path} at step {engine.global_step}", flush=True)
    return engine.global_step, client.get("first_loss")


def evaluate(engine, val: TokenBatches, n_batches: int) -> float:
    n = min(n_batches, max(1, val.n_windows // val.global_batch))
    return sum(engine.eval_batch(val.batch_at(i * val.global_batch)) for i in range(n)) / n
