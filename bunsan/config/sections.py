"""The sections of the config tree, one pydantic model each. DeepSpeed's keys and
defaults where DeepSpeed has them; bunsan's own sections beside them. Cross-field rules
raise Rule so the message names the exact key (see config/errors.py)."""

from __future__ import annotations

import functools
import inspect
import math
from typing import Annotated, Any, Literal, Optional

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from bunsan.config.errors import Rule, show, suggest
from bunsan.optim.optimizers import OPTIMIZERS as optimizer_table, optimizer_class


def _whole(v: Any) -> Any:  # DeepSpeed writes sizes as 5e8, a float in JSON
    return int(v) if isinstance(v, float) and v.is_integer() else v


def _lower(v: Any) -> Any:
    return v.lower() if isinstance(v, str) else v


Int = Annotated[int, BeforeValidator(_whole)]


def Choice(*names: str) -> Any:  # case-insensitive enum of strings
    return Annotated[Literal[names], BeforeValidator(_lower)]


Device = Choice("none", "cpu", "nvme")
Schedule = Choice("gpipe", "1f1b", "interleaved")
Partition = Choice("uniform", "parameters", "balanced")
GlooCollectives = Choice("shm", "exchange", "native")
Backend = Choice("auto", "nccl", "gloo")


class Section(BaseModel):
    # strict: no "yes" -> True or "10" -> 10 coercion; CLI strings are parsed in override()
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class FP16(Section):
    enabled: bool = False
    loss_scale: float = Field(0.0, ge=0)  # 0 = dynamic scaling, else a static scale
    initial_scale_power: Int = Field(16, ge=0, le=64)
    loss_scale_window: Int = Field(1000, ge=1)
    hysteresis: Int = Field(2, ge=1)
    min_loss_scale: float = Field(1.0, gt=0)
    consecutive_hysteresis: bool = False
    auto_cast: bool = False


class BF16(Section):
    enabled: bool = False


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


OPTIMIZERS = {key: kind.name for key, kind in optimizer_table.items()}   # lower-case -> canonical name


@functools.lru_cache(maxsize=None)
def optimizer_signature(name: str) -> dict[str, Any]:
    """Constructor keywords of the optimizer (minus `params`) and their defaults."""
    sig = inspect.signature(optimizer_class(name))
    return {k: p.default for k, p in sig.parameters.items() if k != "params"}


def _check_optimizer_params(name: str, params: dict) -> list[tuple[str, str]]:
    if not params:
        return []
    allowed, problems = optimizer_signature(name), []
    for k, v in params.items():
        key = f"params.{k}"
        if k not in allowed:
            problems.append((key, f"torch.optim.{name} has no parameter '{k}' ({suggest(k, allowed)})"))
            continue
        d = allowed[k]
        if isinstance(d, bool):
            ok, want = isinstance(v, bool), "true or false"
        elif isinstance(d, tuple):
            ok = isinstance(v, (list, tuple)) and len(v) == len(d) and all(x is None or _finite(x) for x in v)
            want = f"a list of {len(d)} finite numbers"
        elif d is None:  # foreach / fused: Optional[bool]
            ok, want = v is None or isinstance(v, bool), "true, false or null"
        else:
            ok, want = _finite(v), "a finite number"
        if not ok:
            problems.append((key, f"expected {want}, got {show(v)}; set it to {want} (torch default {show(d)})"))
        elif k == "lr" and v <= 0:
            problems.append((key, f"must be > 0, got {show(v)}; set it to a positive learning rate, e.g. 3e-4"))
        elif k == "betas" and not all(x is None or 0 <= x < 1 for x in v):
            problems.append((key, f"each beta must be in [0, 1), got {show(v)}; e.g. [0.9, 0.95]"))
    return problems


class Optimizer(Section):
    type: str = "AdamW"
    params: dict[str, Any] = Field(default_factory=dict)  # torch defaults are merged in by bunsan.optim

    @model_validator(mode="before")
    @classmethod
    def _normalise(cls, data: Any) -> Any:
        if not isinstance(data, dict) or not isinstance(data.get("type", ""), str):
            return data  # pydantic reports the type error
        data, params = dict(data), data.get("params") or {}
        if not isinstance(params, dict):
            return data
        params, name = dict(params), data.get("type", "AdamW")
        canon = OPTIMIZERS.get(name.lower())
        if canon is None:
            raise Rule(("type", f"unknown optimizer {show(name)} ({suggest(name, OPTIMIZERS.values())}); "
                                f"set it to one of {', '.join(OPTIMIZERS.values())}"))
        if canon in ("Adam", "AdamW"):  # DeepSpeed's extra Adam switches
            for k in ("adam_w_mode", "torch_adam"):
                if not isinstance(params.get(k, False), bool):
                    raise Rule((f"params.{k}", f"expected true/false, got {show(params[k])}; set it to true or false"))
            if params.pop("adam_w_mode", False):
                canon = "AdamW"
            params.pop("torch_adam", None)  # bunsan always uses torch's optimizers
        if problems := _check_optimizer_params(canon, params):
            raise Rule(*problems)
        return {**data, "type": canon, "params": params}


_WARMUP = {"warmup_min_lr": 0.0, "warmup_max_lr": 0.001, "warmup_num_steps": 1000, "warmup_type": "log"}
_OWN = {"warmup_steps": 0, "total_steps": None, "min_lr_ratio": 0.1}  # total_steps None -> train.steps
SCHEDULERS: dict[str, dict[str, Any]] = {  # type -> params and defaults; ... = required
    "WarmupLR": _WARMUP,
    "WarmupDecayLR": {**_WARMUP, "total_num_steps": ...},
    "WarmupCosineLR": {"total_num_steps": ..., "warmup_min_ratio": 0.0, "warmup_num_steps": 1000,
                       "cos_min_ratio": 0.0001, "warmup_type": "log"},
    "constant": {},
    "warmup_cosine": _OWN,
    "warmup_linear": _OWN,
}


def _check_schedule_value(k: str, v: Any) -> tuple[Any, str | None]:
    """(normalised value, problem or None) for one scheduler parameter."""
    if k == "warmup_type":
        ok = isinstance(v, str) and v.lower() in ("log", "linear")
        return (v.lower() if ok else v), None if ok else f"must be 'log' or 'linear', got {show(v)}; set it to 'log' or 'linear'"
    if v is None and k == "total_steps":
        return v, None
    if not _finite(v):
        return v, f"expected a finite number, got {show(v)}; set it to a number"
    if k.endswith("_steps"):
        low = 1 if k.startswith("total") else 0
        if not float(v).is_integer() or v < low:
            return v, f"must be a whole number >= {low}, got {show(v)}; set it to a step count >= {low}"
        return int(v), None
    if k.endswith("_ratio") and not 0 <= v <= 1:
        return v, f"must be in [0, 1], got {show(v)}; set it to a fraction of the peak learning rate"
    if k.endswith("_lr") and v < 0:
        return v, f"must be >= 0, got {show(v)}; set it to a non-negative learning rate"
    return v, None


class Scheduler(Section):
    type: str
    params: dict[str, Any] = Field(default_factory=dict)  # defaults filled in

    @model_validator(mode="before")
    @classmethod
    def _normalise(cls, data: Any) -> Any:
        if isinstance(data, dict) and "type" not in data:
            raise Rule(("type", f"a scheduler needs a type; set scheduler.type to one of {', '.join(SCHEDULERS)}"))
        if not isinstance(data, dict) or not isinstance(data.get("type"), str):
            return data
        params = data.get("params") or {}
        if not isinstance(params, dict):
            return data
        name = data["type"]
        canon = {n.lower(): n for n in SCHEDULERS}.get(name.lower())
        if canon is None:
            raise Rule(("type", f"unknown scheduler {show(name)} ({suggest(name, SCHEDULERS)}); "
                                f"set it to one of {', '.join(SCHEDULERS)}"))
        spec, out, problems = SCHEDULERS[canon], {}, []
        for k, v in params.items():
            if k not in spec:
                problems.append((f"params.{k}", f"scheduler {canon} has no parameter '{k}' ({suggest(k, spec)})"))
                continue
            out[k], problem = _check_schedule_value(k, v)
            if problem:
                problems.append((f"params.{k}", problem))
        for k, d in spec.items():
            if k not in out and d is ...:
                problems.append((f"params.{k}", f"scheduler {canon} requires '{k}'; add it (the total number of training steps)"))
            out.setdefault(k, d)
        if problems:
            raise Rule(*problems)
        return {**data, "type": canon, "params": out}


class Offload(Section):
    device: Device = "none"
    nvme_path: Optional[str] = None
    pin_memory: bool = False
    buffer_count: Int = Field(4, ge=1)
    fast_init: bool = False

    @model_validator(mode="after")
    def _nvme(self) -> Offload:
        if self.device == "nvme" and not self.nvme_path:
            raise Rule(("nvme_path", "device is 'nvme' but nvme_path is not set; set nvme_path to a directory "
                                     "on a local NVMe drive, or use device 'cpu'"))
        return self


def offloads(o: Offload | None) -> bool:
    return o is not None and o.device != "none"


class Zero(Section):
    stage: Int = Field(0, ge=0, le=3)
    # Elements per gradient bucket. DeepSpeed's default (5e8) puts a small model in one bucket, which
    # cannot overlap backward; bunsan's is 1e7 (40 MB of fp32), near torch DDP's 25 MB.
    reduce_bucket_size: Int = Field(10_000_000, ge=1)
    allgather_bucket_size: Int = Field(500_000_000, ge=1)
    overlap_comm: bool = True
    contiguous_gradients: bool = True
    reduce_scatter: bool = True
    allgather_partitions: bool = True
    stage3_prefetch_bucket_size: Int = Field(50_000_000, ge=0)
    stage3_param_persistence_threshold: Int = Field(100_000, ge=0)
    stage3_max_live_parameters: Int = Field(1_000_000_000, ge=0)
    stage3_max_reuse_distance: Int = Field(1_000_000_000, ge=0)
    stage3_gather_16bit_weights_on_model_save: bool = False
    sub_group_size: Int = Field(1_000_000_000, ge=1)
    # bunsan: class names of the modules gathered as one ZeRO-3 unit ([] = the elements of model.layers)
    stage3_unit_modules: list[str] = []
    # bunsan, CPU only: give the heap's free pages back to the OS every 4 reduced buckets (stage 2) or
    # released ZeRO-3 units, and after each ZeRO-3 step (glibc malloc_trim), so resident memory follows what
    # is held; costs page faults. Stage 1 never trims (see zero/stage12.py)
    trim_host_memory: bool = True
    offload_optimizer: Optional[Offload] = None
    offload_param: Optional[Offload] = None

    @model_validator(mode="after")
    def _offload_stage(self) -> Zero:
        problems = []
        if offloads(self.offload_param) and self.stage < 3:
            problems.append(("offload_param", f"offload_param needs stage 3 (parameters are only sharded in "
                                              f"ZeRO-3), got stage {self.stage}; set zero_optimization.stage to 3 "
                                              f"or remove offload_param"))
        if offloads(self.offload_optimizer) and self.stage < 1:
            problems.append(("offload_optimizer", "offload_optimizer needs ZeRO stage 1, 2 or 3, got stage 0; "
                                                  "set zero_optimization.stage to 1 or more or remove offload_optimizer"))
        if problems:
            raise Rule(*problems)
        return self


class ActivationCheckpointing(Section):
    enabled: bool = False  # bunsan's switch; the rest are DeepSpeed's keys
    partition_activations: bool = False
    cpu_checkpointing: bool = False
    contiguous_memory_optimization: bool = False
    number_checkpoints: Optional[Int] = Field(None, ge=1)
    synchronize_checkpoint_boundary: bool = False
    profile: bool = False


class Lora(Section):
    """Low-rank adapters (peft) on the named linear layers; the base weights are frozen."""
    enabled: bool = False
    r: Int = Field(8, ge=1)
    alpha: float = Field(16.0, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: list[str] = Field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])


class Tensorboard(Section):
    enabled: bool = False
    output_path: str = ""
    job_name: str = "bunsan"


class TensorParallel(Section):
    size: Int = Field(1, ge=1)
    sequence_parallel: bool = False

    @model_validator(mode="after")
    def _sp(self) -> TensorParallel:
        if self.sequence_parallel and self.size == 1:
            raise Rule(("sequence_parallel", "sequence parallelism splits activations across tensor-parallel "
                                             "ranks and needs size > 1, got size 1; set tensor_parallel.size to 2 "
                                             "or more, or set sequence_parallel to false"))
        return self


class Pipeline(Section):
    stages: Int = Field(1, ge=1)
    schedule: Schedule = "1f1b"
    virtual_stages: Int = Field(1, ge=1)
    partition: Partition = "uniform"

    @model_validator(mode="after")
    def _virtual(self) -> Pipeline:
        if self.virtual_stages > 1 and self.schedule != "interleaved":
            raise Rule(("virtual_stages", f"virtual_stages {self.virtual_stages} needs the interleaved schedule, "
                                          f"got schedule '{self.schedule}'; set pipeline.schedule to 'interleaved' "
                                          f"or virtual_stages to 1"))
        return self


OptInt = Optional[Int]  # None = not set


class ModelOverrides(Section):
    preset: str = "small"
    vocab_size: OptInt = Field(None, ge=1)
    hidden_size: OptInt = Field(None, ge=1)
    intermediate_size: OptInt = Field(None, ge=1)
    num_hidden_layers: OptInt = Field(None, ge=1)
    num_attention_heads: OptInt = Field(None, ge=1)
    num_key_value_heads: OptInt = Field(None, ge=1)
    max_position_embeddings: OptInt = Field(None, ge=1)
    rms_norm_eps: Optional[float] = Field(None, gt=0)
    rope_theta: Optional[float] = Field(None, gt=0)
    tie_word_embeddings: Optional[bool] = None

    @model_validator(mode="after")
    def _heads(self) -> ModelOverrides:
        h, a, k, problems = self.hidden_size, self.num_attention_heads, self.num_key_value_heads, []
        if h and a and h % a:
            problems.append(("hidden_size", f"hidden_size {h} is not divisible by num_attention_heads {a}; set "
                                            f"hidden_size to a multiple of {a} (e.g. {max(a, h // a * a)})"))
        if a and k and a % k:
            divisors = ", ".join(str(d) for d in range(1, a + 1) if a % d == 0)
            problems.append(("num_key_value_heads", f"num_attention_heads {a} is not divisible by "
                                                    f"num_key_value_heads {k}; set num_key_value_heads to one of {divisors}"))
        if problems:
            raise Rule(*problems)
        return self


class Data(Section):
    paths: list[str] = Field(default_factory=list)  # files or globs; [] = the built-in corpus
    tokenizer: Optional[str] = None  # path to a Hugging Face tokenizer.json; None = bytes
    seq_len: Int = Field(256, ge=2)
    num_workers: Int = Field(0, ge=0)
    pin_memory: bool = False
    prefetch_factor: Int = Field(2, ge=1)
    cache_dir: Optional[str] = None
    max_bytes: OptInt = Field(None, ge=1)
    val_fraction: float = Field(0.01, ge=0, lt=0.5)


class Checkpoint(Section):
    dir: Optional[str] = None          # where `bunsan train` saves (and resumes from)
    save_interval: Int = Field(0, ge=0)  # optimizer steps between saves; 0 = only at the end (with dir set)
    keep_last: Int = Field(3, ge=1)
    resume: bool = True                # `bunsan train` continues from the newest whole checkpoint in dir

    @model_validator(mode="after")
    def _dir(self) -> Checkpoint:
        if self.save_interval and not self.dir:
            raise Rule(("save_interval", f"save_interval {self.save_interval} needs a directory to save into; "
                                         "set checkpoint.dir (e.g. runs/bunsan/checkpoints) or save_interval 0"))
        return self


class Train(Section):
    steps: Int = Field(200, ge=1)
    seed: Int = Field(1234, ge=0)
    output_dir: str = "runs/bunsan"
    init_from: Optional[str] = None    # a Hugging Face Llama directory: its shape and weights start the run
    compile: bool = False
    tf32: bool = True
    eval_interval: Int = Field(0, ge=0)
    eval_batches: Int = Field(4, ge=1)
    # Collective timeout; unset: 600 s on NCCL (also its watchdog's: a first compiled step or a slow checkpoint
    # barrier must not abort the job), 120 s on gloo (distributed.collective_timeout)
    timeout_s: Optional[float] = Field(None, gt=0)
    # auto: NCCL on GPUs, gloo on CPUs. gloo on GPUs lets ranks share one GPU (collectives through host copies)
    backend: Backend = "auto"
    comm_warn_share: float = Field(0.3, ge=0, le=1)  # the doctor speaks when waiting on comm exceeds this share
    # On gloo: collectives through shared memory where a group's ranks share a host (shm: no loopback TCP), else
    # all-gather and reduce-scatter as point-to-point exchanges (exchange: all in flight at once); comm/collectives.py
    gloo_collectives: GlooCollectives = "shm"
    metrics_file: str = "metrics.jsonl"
    log_memory: bool = True
