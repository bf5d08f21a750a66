"""One typed config tree. DeepSpeed's keys work unchanged; bunsan's own sections sit
beside them. Everything is validated before any work starts: unknown keys, wrong types,
ranges and cross-field rules all raise ConfigError naming the key and the fix."""

from __future__ import annotations

import os
import typing
from dataclasses import dataclass
from typing import Any, Optional

import yaml
from pydantic import Field, ValidationError, model_validator

from bunsan.config.bunsan_sections import (Checkpoint, ContextParallel, Data, Dpo, ExpertParallel, Lora,
                                          ModelOverrides, Orpo, Pipeline, Simpo, TensorParallel, Train)
from bunsan.config.data_efficiency import DataEfficiency
from bunsan.config.deepspeed_intake import prepare, row_for
from bunsan.config.deepspeed_keys import IgnoredKeyWarning, canonical, log_ignored, say_once
from bunsan.config.errors import ConfigError, Rule, convert, lookup, unwrap
from bunsan.config.files import YamlLoader, read_config_file
from bunsan.config.optimizer_sections import OPTIMIZERS, SCHEDULERS, Optimizer, Scheduler, optimizer_signature
from bunsan.config.sections import (BF16, FP16, ActivationCheckpointing, HybridEngine, Int, OptInt, Section,
                                     Tensorboard, Zero)

__all__ = ["BatchSizes", "Config", "ConfigError"]


@dataclass(frozen=True)
class BatchSizes:
    train_batch_size: int
    micro_batch: int
    grad_accum: int
    dp_size: int


# Features that parse but are not built yet: (the key the row is about, predicate, message formatted with
# c=config). bunsan.initialize raises ConfigError with the messages of the rows that hold; loading does not,
# so plans and estimates can still price such a config. Delete a row when its feature lands.
UNIMPLEMENTED: list[tuple[str, typing.Callable[[Config], bool], str]] = [
    ("activation_checkpointing.partition_activations", lambda c: c.activation_checkpointing.partition_activations,
     "activation_checkpointing.partition_activations=true: partitioning checkpointed activations across "
     "tensor-parallel ranks is not implemented; use tensor_parallel.sequence_parallel, which shards the "
     "activations between blocks, and set partition_activations to false"),
    # (not a missing feature: a DeepSpeed config that asks it without model-code checkpointing still prices)
    ("activation_checkpointing.cpu_checkpointing",
     lambda c: c.activation_checkpointing.cpu_checkpointing and c.activation_checkpointing.recompute_mode == "none",
     "activation_checkpointing.cpu_checkpointing=true moves checkpointed activations to host memory, but "
     "nothing is checkpointed (DeepSpeed checkpoints from model code, bunsan from the config): set "
     "activation_checkpointing.mode to full or selective, or use offload_blocks to offload without recompute"),
]


NEVER = 2 ** 62   # steps_per_print that no run reaches


class Config(Section):
    """The whole config. Build it with Config.load(dict | path | Config | None); derive
    variants with override({"dotted.key": value}); every problem raises ConfigError."""

    # (one-line descriptions: `bunsan config --explain KEY`; a section's is its class docstring)
    train_batch_size: OptInt = Field(None, ge=1, description="Samples per optimizer step over all data-parallel "
                                     "ranks = micro-batch x accumulation x dp size; None = derived (DeepSpeed's)")
    train_micro_batch_size_per_gpu: OptInt = Field(None, ge=1, description="Samples per forward and backward on "
                                                   "each data-parallel rank; None = derived, or 8 (DeepSpeed's)")
    gradient_accumulation_steps: OptInt = Field(None, ge=1, description="Micro-batches per optimizer step (the "
                                                "pipeline's micro-batches); None = derived, or 1 (DeepSpeed's)")
    gradient_clipping: float = Field(0.0, ge=0, description="Clip the global gradient L2 norm to this before the "
                                                            "step; 0 = off (DeepSpeed's meaning)")
    steps_per_print: Int = Field(10, ge=1, description="Optimizer steps between metric records (loss, lr, "
                                                       "tokens/s), printed and written (DeepSpeed's meaning)")
    wall_clock_breakdown: bool = Field(False, description="DeepSpeed's per-phase timing print; accepted and "
                                                          "ignored (bunsan config --explain gives the reason)")
    prescale_gradients: bool = Field(False, description="DeepSpeed: divide gradients before the all-reduce; "
                                                        "accepted and ignored (bunsan config --explain)")
    zero_allow_untested_optimizer: bool = Field(False, description="DeepSpeed: allow a client optimizer under "
                                                                   "ZeRO; accepted and ignored (bunsan config --explain)")
    dataloader_drop_last: bool = Field(False, description="DeepSpeed: the loader deepspeed.initialize makes from "
                                                          "training_data drops a last, incomplete micro-batch")
    fp16: FP16 = Field(default_factory=FP16, description=FP16.__doc__)
    bf16: BF16 = Field(default_factory=BF16, description=BF16.__doc__)
    optimizer: Optimizer = Field(default_factory=Optimizer, description=Optimizer.__doc__)
    scheduler: Optional[Scheduler] = Field(None, description="The learning-rate schedule (DeepSpeed's section and "
                                                             "types, and bunsan's); None = constant lr")
    zero_optimization: Zero = Field(default_factory=Zero, description=Zero.__doc__)
    activation_checkpointing: ActivationCheckpointing = Field(default_factory=ActivationCheckpointing,
                                                              description=ActivationCheckpointing.__doc__)
    tensorboard: Tensorboard = Field(default_factory=Tensorboard, description=Tensorboard.__doc__)
    tensor_parallel: TensorParallel = Field(default_factory=TensorParallel, description=TensorParallel.__doc__)
    context_parallel: ContextParallel = Field(default_factory=ContextParallel, description=ContextParallel.__doc__)
    expert_parallel: ExpertParallel = Field(default_factory=ExpertParallel, description=ExpertParallel.__doc__)
    pipeline: Pipeline = Field(default_factory=Pipeline, description=Pipeline.__doc__)
    lora: Lora = Field(default_factory=Lora, description=Lora.__doc__)
    model: ModelOverrides = Field(default_factory=ModelOverrides, description=ModelOverrides.__doc__)
    data: Data = Field(default_factory=Data, description=Data.__doc__)
    checkpoint: Checkpoint = Field(default_factory=Checkpoint, description=Checkpoint.__doc__)
    train: Train = Field(default_factory=Train, description=Train.__doc__)
    dpo: Dpo = Field(default_factory=Dpo, description=Dpo.__doc__)
    simpo: Simpo = Field(default_factory=Simpo, description=Simpo.__doc__)
    orpo: Orpo = Field(default_factory=Orpo, description=Orpo.__doc__)
    hybrid_engine: HybridEngine = Field(default_factory=HybridEngine, description=HybridEngine.__doc__)
    data_efficiency: DataEfficiency = Field(default_factory=DataEfficiency, description=DataEfficiency.__doc__)

    @model_validator(mode="before")
    @classmethod
    def _deepspeed_forms(cls, data: Any) -> Any:
        data = prepare(data)   # DeepSpeed's old forms and spellings, and its keys bunsan has no field for
        if isinstance(data, dict) and data.get("steps_per_print") == float("inf"):
            # accelerate writes inf for "never" (DeepSpeed compares step % inf): the same, as a whole number
            data = {**data, "steps_per_print": NEVER}
        return data

    @model_validator(mode="after")
    def _precision(self) -> Config:
        if self.fp16.enabled and self.bf16.enabled:
            raise Rule(("fp16.enabled", "fp16 and bf16 are both enabled; set fp16.enabled or bf16.enabled to "
                                        "false (bf16 needs no loss scaling, prefer it where the hardware has it)"))
        return self

    @model_validator(mode="after")
    def _compiled_blocks(self) -> Config:
        ac = self.activation_checkpointing
        if self.train.compile and (ac.recompute_mode == "selective" or ac.offloaded):
            what = "mode selective (its policy follows module hooks)" if ac.recompute_mode == "selective" \
                else f"offload_blocks {ac.offloaded} (its saved-tensor hooks)"
            raise Rule(("train.compile", f"train.compile with activation_checkpointing.{what}: torch.compile "
                                         "cannot trace it and would run those blocks uncompiled; set "
                                         "train.compile to false, or use mode full without offload"))
        return self

    @model_validator(mode="after")
    def _said_but_inert(self) -> Config:
        if self.train.eval_interval and not self.data.val_fraction:
            raise Rule(("train.eval_interval", f"train.eval_interval {self.train.eval_interval} with "
                                               "data.val_fraction 0: there is no validation split to evaluate; "
                                               "set data.val_fraction (e.g. 0.01) or eval_interval to 0"))
        if self.data.packing and (self.pipeline.stages > 1 or self.context_parallel.size > 1
                                  or self.tensor_parallel.sequence_parallel):
            raise Rule(("data.packing", "data.packing with pipeline stages, context or sequence parallelism: "
                                        "the documents' attention needs the whole row in one place; set "
                                        "data.packing to false there (one example per row)"))
        if self.data.format == "preference" and (self.train.objective == "lm" or self.data.packing
                                                 or self.data.train_on_prompt):
            raise Rule(("data.format", "data.format preference trains with train.objective dpo, simpo or orpo, one "
                                       "pair per two rows, scoring the responses only: set train.objective, and "
                                       "data.packing and data.train_on_prompt false"))
        if self.lora.enabled and self.lora.save != "merged" and not self.train.init_from:
            raise Rule(("lora.save", f"lora.save {self.lora.save!r} without train.init_from: a peft adapter names "
                                     "the base model it adapts, and a run from fresh weights has none on disk; "
                                     "set train.init_from (the base), or lora.save merged"))
        ac = self.activation_checkpointing
        deepspeed_only = {"partition_activations", "contiguous_memory_optimization", "number_checkpoints",
                          "synchronize_checkpoint_boundary", "profile", "cpu_checkpointing"}
        if ac.model_fields_set & deepspeed_only and not ac.model_fields_set & {"enabled", "mode"}:
            say_once("activation_checkpointing", "activation_checkpointing has DeepSpeed's keys but neither "
                     "enabled nor mode: DeepSpeed checkpoints where model code calls deepspeed.checkpointing, "
                     "bunsan recomputes only when activation_checkpointing.enabled is true (or mode is set); as "
                     "written nothing is recomputed", IgnoredKeyWarning)
        return self

    @model_validator(mode="after")
    def _context_parallel(self) -> Config:
        # (the sequence length rule, a multiple of 2 x size, is checked where rows are cut: data.seq_len is
        # only `bunsan train`'s, and initialize's rows come from the caller)
        cp = self.context_parallel.size
        if cp > 1 and self.train.compile:
            raise Rule(("train.compile", f"train.compile with context_parallel.size {cp}: compiled blocks with "
                                         "the K/V all-gather inside are not supported yet; set train.compile to "
                                         "false or context_parallel.size to 1"))
        return self

    @model_validator(mode="after")
    def _log_ignored(self) -> Config:
        log_ignored(self)  # DeepSpeed keys bunsan has no use for: said once, never silently accepted
        return self

    @classmethod
    def load(cls, src: dict | str | os.PathLike | Config | None = None) -> Config:
        """Defaults (None), a dict, a .json/.yaml/.yml/.toml path, or a Config (re-validated copy)."""
        where = ""
        if src is None:
            data: Any = {}
        elif isinstance(src, Config):
            data = src.to_dict()
        elif isinstance(src, dict):
            data = src
        elif isinstance(src, (str, os.PathLike)):
            data, where = read_config_file(src), f"config file '{src}'"
        else:
            raise ConfigError(f"config must be a dict, a file path or a bunsan.Config, got {type(src).__name__}")
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            raise convert(e, cls, where) from None

    def to_dict(self) -> dict:
        return self.model_dump(mode="json")

    def override(self, updates: dict[str, Any]) -> Config:
        """A new Config with dotted keys replaced: {"zero_optimization.stage": 2}. String values
        (from the command line) are read as YAML scalars: "10", "true", "1e-3", "[0.9, 0.95]"."""
        data = self.to_dict()
        for path, value in updates.items():
            path = canonical(str(path))
            found = row_for(path)   # a DeepSpeed key bunsan has no field for
            if found is not None and found[1].refused:
                raise ConfigError(f"{path}: {found[1].why}")
            parts = path.split(".")
            field = lookup(Config, parts)
            if isinstance(value, str):
                value = _parse_cli(path, value, field)
            node = data
            for p in parts[:-1]:
                if not isinstance(node.get(p), dict):
                    node[p] = {}  # a section that is None now (scheduler, offload_*)
                node = node[p]
            if parts[-1] == "type" and parts[0] in ("optimizer", "scheduler") and isinstance(value, str):
                _keep_params_of(parts[0], value, node)
            node[parts[-1]] = value
        return Config.load(data)

    def batch_sizes(self, dp_size: int) -> BatchSizes:
        """DeepSpeed's rule train_batch_size = micro_batch x grad_accum x dp_size; any two give
        the third. Only train_batch_size: grad_accum 1. Otherwise micro 8 and grad_accum 1 by default."""
        if isinstance(dp_size, bool) or not isinstance(dp_size, int) or dp_size < 1:
            raise ConfigError(f"data-parallel size must be a positive integer, got {dp_size!r}")
        tbs, mb, ga = self.train_batch_size, self.train_micro_batch_size_per_gpu, self.gradient_accumulation_steps
        if tbs is None:
            mb, ga = mb or 8, ga or 1
            return BatchSizes(mb * ga * dp_size, mb, ga, dp_size)
        if mb is not None and ga is not None:
            if tbs != mb * ga * dp_size:
                raise ConfigError(_mismatch(tbs, mb, ga, dp_size))
        elif mb is not None:
            ga = _divide(tbs, f"train_micro_batch_size_per_gpu {mb} x ", mb, dp_size)
        elif ga is not None:
            mb = _divide(tbs, f"gradient_accumulation_steps {ga} x ", ga, dp_size)
        else:
            mb, ga = _divide(tbs, "", 1, dp_size), 1
        return BatchSizes(tbs, mb, ga, dp_size)

    def unimplemented(self) -> list[str]:
        return [msg.format(c=self) for _, pred, msg in UNIMPLEMENTED if pred(self)]


def _parse_cli(path: str, value: str, field: Any) -> Any:
    ann = unwrap(field.annotation) if field is not None else None
    if ann is str:  # keep paths and names verbatim ("1e3" stays a string)
        nullable = type(None) in typing.get_args(field.annotation)
        return None if nullable and value in ("null", "~") else value
    try:
        parsed = yaml.load(value, Loader=YamlLoader)
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: could not read {value!r} as a YAML value ({e}); quote strings and "
                          f"write lists as [a, b]") from None
    return [parsed] if ann == list[str] and isinstance(parsed, str) else parsed


def _keep_params_of(section: str, new_type: str, node: dict) -> None:
    """On a type change, drop params the new type does not take (e.g. WarmupLR's filled-in defaults)."""
    if section == "optimizer":
        canon = OPTIMIZERS.get(new_type.lower())
        names = set(optimizer_signature(canon)) if canon else None
    else:
        canon = {n.lower(): n for n in SCHEDULERS}.get(new_type.lower())
        names = set(SCHEDULERS[canon]) if canon else None
    if names is not None and isinstance(node.get("params"), dict) and canon != node.get("type"):
        node["params"] = {k: v for k, v in node["params"].items() if k in names}


def _divide(tbs: int, what: str, factor: int, dp: int) -> int:
    unit = factor * dp
    if tbs % unit:
        lo = tbs // unit * unit
        choices = f"{lo} or {lo + unit}" if lo else f"{unit}"
        raise ConfigError(f"train_batch_size {tbs} is not divisible by {what}data-parallel size {dp} "
                          f"(= {unit}); set train_batch_size to {choices}")
    return tbs // unit


def _mismatch(tbs: int, mb: int, ga: int, dp: int) -> str:
    prod = mb * ga * dp
    if tbs % (mb * dp) == 0:
        fix = f"set gradient_accumulation_steps to {tbs // (mb * dp)}"
    elif tbs % (ga * dp) == 0:
        fix = f"set train_micro_batch_size_per_gpu to {tbs // (ga * dp)}"
    else:
        fix = f"set train_batch_size to {prod} (or remove it and it is derived)"
    return (f"train_batch_size {tbs} != micro_batch {mb} x grad_accum {ga} x data-parallel size {dp} "
            f"(= {prod}); {fix}")
