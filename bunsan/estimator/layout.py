"""A layout: how one training job is spread over GPUs, and the config file that runs it.

The estimator prices a layout in bytes, the cost model in seconds, the planner searches
over them; `to_config()` writes the bunsan/DeepSpeed-style config `bunsan train` and
`bunsan.initialize` take unchanged.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from bunsan.models.blocks import SELECTIVE_OPS

PRECISIONS = ("fp32", "bf16", "fp16")
OFFLOAD = ("none", "cpu", "nvme")
RECOMPUTE = ("none", "full", "selective")


@dataclass(frozen=True)
class Layout:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    zero: int = 0                     # ZeRO stage 0-3 over the data-parallel group (dp x cp ranks)
    micro_batch: int = 1              # samples per micro-batch per data-parallel rank
    grad_accum: int = 1               # micro-batches per step (the pipeline's micro-batches under PP)
    seq_len: int = 2048
    precision: str = "bf16"           # fp32 | bf16 | fp16 (16-bit keeps fp32 master weights)
    optimizer: str = "AdamW"          # AdamW | Adam | SGD | Adafactor | AdamW8bit
    checkpointing: bool | str = False   # recompute in backward: "none" (False), "full" (True), "selective"
    recompute_ops: tuple = SELECTIVE_OPS    # what selective recompute re-runs
    offload_blocks: int | str = 0     # blocks per rank whose saved activations live in host memory, or "all"
    sequence_parallel: bool = False
    schedule: str = "1f1b"            # gpipe | 1f1b | interleaved (only with pp > 1)
    virtual_stages: int = 1
    offload_optimizer: str = "none"   # none | cpu | nvme
    offload_param: str = "none"       # none | cpu | nvme (ZeRO-3)
    pipeline_gather: str = "micro_batch"   # ZeRO-3 with pp > 1: micro_batch | schedule (zero/stage3.py)
    cp: int = 1                       # context parallel: each row's tokens split over cp ranks
    loss_fn: bool = False             # a user's loss_fn: under tp > 1 it gets the whole logits, gathered
    padding_mask: bool = False        # batches carry a padding attention_mask (a transformers model's blocks)
    # expert parallelism: a MoE model's experts split over ep of the dp x cp ranks (folded over them, as the
    # engine's mesh does: comm/mesh.py), their gradients reduced and ZeRO-sharded over the dp x cp / ep others
    ep: int = 1

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp", "cp", "ep", "micro_batch", "grad_accum", "seq_len", "virtual_stages"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"Layout.{name} must be a positive int, got {v!r}")
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"Layout.zero must be 0, 1, 2 or 3, got {self.zero!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"Layout.precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        for name in ("offload_optimizer", "offload_param"):
            if getattr(self, name) not in OFFLOAD:
                raise ValueError(f"Layout.{name} must be one of {', '.join(OFFLOAD)}, got {getattr(self, name)!r}")
        if self.pipeline_gather not in ("micro_batch", "schedule"):
            raise ValueError(f"Layout.pipeline_gather must be micro_batch or schedule, got {self.pipeline_gather!r}")
        self._check_recompute()
        if self.shard_ranks % self.ep:
            raise ValueError(f"Layout.ep {self.ep} does not divide dp {self.dp} x cp {self.cp} = {self.shard_ranks}: "
                             "expert parallelism folds over the data- and context-parallel ranks; use an ep that "
                             f"divides {self.shard_ranks}")
        if self.cp > 1 and self.seq_len % (2 * self.cp):
            raise ValueError(f"Layout.seq_len {self.seq_len} is not divisible by 2 x cp = {2 * self.cp}: context "
                             "parallelism cuts each row into 2 x cp equal chunks; use a multiple of it")

    def _check_recompute(self) -> None:
        mode = {False: "none", True: "full"}.get(self.checkpointing, self.checkpointing)
        if mode not in RECOMPUTE:
            raise ValueError(f"Layout.checkpointing must be one of {', '.join(RECOMPUTE)} (or a bool), got "
                             f"{self.checkpointing!r}")
        object.__setattr__(self, "checkpointing", mode)      # one spelling per mode
        object.__setattr__(self, "recompute_ops", tuple(self.recompute_ops))
        if not set(self.recompute_ops) <= set(SELECTIVE_OPS):
            raise ValueError(f"Layout.recompute_ops must be drawn from {SELECTIVE_OPS}, got {self.recompute_ops!r}")
        n = self.offload_blocks
        if n != "all" and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
            raise ValueError(f"Layout.offload_blocks must be a count >= 0 or 'all', got {n!r}")

    @property
    def gpus(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    @property
    def shard_ranks(self) -> int:
        """The ranks gradients are reduced and ZeRO shards spread over: dp x cp (context-parallel ranks hold
        the same weights)."""
        return self.dp * self.cp

    @property
    def expert_shard_ranks(self) -> int:
        """The ranks an expert's gradients are reduced and its ZeRO shards spread over: dp x cp / ep."""
        return self.shard_ranks // self.ep

    @property
    def rank_tokens(self) -> int:
        """Tokens of each row one rank holds."""
        return self.seq_len // self.cp

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step."""
        return self.dp * self.micro_batch * self.grad_accum

    @property
    def dtype_bytes(self) -> int:
        return 4 if self.precision == "fp32" else 2

    def replace(self, **changes) -> Layout:
        return dataclasses.replace(self, **changes)

    def describe(self) -> str:
        """One short line: dp2 tp4 pp2(1f1b) zero1 mb1x8 bf16 ckpt."""
        parts = [f"dp{self.dp}"] + ([f"cp{self.cp}"] if self.cp > 1 else []) + \
            [f"tp{self.tp}" + ("+sp" if self.sequence_parallel else "")] + ([f"ep{self.ep}"] if self.ep > 1 else [])
        if self.pp > 1:
            sched = self.schedule + (f"/v{self.virtual_stages}" if self.virtual_stages > 1 else "")
            parts.append(f"pp{self.pp}({sched})")
        parts += [f"zero{self.zero}", f"mb{self.micro_batch}x{self.grad_accum}", self.precision]
        if self.optimizer != "AdamW":
            parts.append(self.optimizer)
        if self.checkpointing != "none":
            ops = "" if self.recompute_ops == SELECTIVE_OPS else "(" + "+".join(self.recompute_ops) + ")"
            parts.append("ckpt" if self.checkpointing == "full" else "sel" + ops)
        if self.offload_blocks:
            parts.append(f"act->cpu({self.offload_blocks})")
        if self.offload_optimizer != "none":
            parts.append(f"opt->{self.offload_optimizer}")
        if self.offload_param != "none":
            parts.append(f"param->{self.offload_param}")
        return " ".join(parts)

    def to_config(self, base: dict | None = None, nvme_path: str = "/local_nvme") -> dict:
        """The config dict for this layout; `base` (a config dict) supplies everything else."""
        cfg = {k: (dict(v) if isinstance(v, dict) else v) for k, v in (base or {}).items()}
        for key in ("train_batch_size",):   # the layout decides the batch split
            cfg.pop(key, None)
        cfg["train_micro_batch_size_per_gpu"] = self.micro_batch
        cfg["gradient_accumulation_steps"] = self.grad_accum
        cfg["fp16"] = {**cfg.get("fp16", {}), "enabled": self.precision == "fp16"}
        cfg["bf16"] = {**cfg.get("bf16", {}), "enabled": self.precision == "bf16"}
        zero = {**cfg.get("zero_optimization", {}), "stage": self.zero}
        for key, device in (("offload_optimizer", self.offload_optimizer), ("offload_param", self.offload_param)):
            if device == "none":
                zero.pop(key, None)
            else:
                zero[key] = {"device": device, **({"nvme_path": nvme_path} if device == "nvme" else {})}
        if self.zero == 3 and self.pp > 1:
            zero["stage3_pipeline_gather"] = self.pipeline_gather
        cfg["zero_optimization"] = zero
        cfg["activation_checkpointing"] = self._recompute_section(cfg.get("activation_checkpointing", {}))
        cfg["tensor_parallel"] = {"size": self.tp, "sequence_parallel": self.sequence_parallel}
        if self.ep > 1 or "expert_parallel" in cfg:
            cfg["expert_parallel"] = {**cfg.get("expert_parallel", {}), "enabled": self.ep > 1, "autoep_size": self.ep}
        if self.cp > 1 or "context_parallel" in cfg:
            cfg["context_parallel"] = {"size": self.cp}
        cfg["pipeline"] = {**cfg.get("pipeline", {}), "stages": self.pp, "schedule": self.schedule,
                           "virtual_stages": self.virtual_stages}
        if self.optimizer != cfg.get("optimizer", {}).get("type", "AdamW"):
            cfg["optimizer"] = {"type": self.optimizer, "params": {}}
        cfg["data"] = {**cfg.get("data", {}), "seq_len": self.seq_len}
        return cfg

    def _recompute_section(self, base: dict) -> dict:
        """The activation_checkpointing section: `base`'s keys, its recompute and offload this layout's."""
        section = {k: v for k, v in base.items() if k not in ("recompute", "cpu_checkpointing")}
        section.update(enabled=self.checkpointing != "none", mode=self.checkpointing,
                       offload_blocks=self.offload_blocks)
        if self.checkpointing == "selective" and self.recompute_ops != SELECTIVE_OPS:
            section["recompute"] = list(self.recompute_ops)
        return section

    @classmethod
    def from_config(cls, cfg, world: int) -> Layout:
        """The layout a bunsan.Config describes on `world` processes."""
        tp, pp, cp = cfg.tensor_parallel.size, cfg.pipeline.stages, cfg.context_parallel.size
        if world % (tp * pp * cp):
            raise ValueError(f"{world} GPUs cannot hold tensor_parallel.size {tp} x pipeline.stages {pp} x "
                             f"context_parallel.size {cp}; use a GPU count that is a multiple of {tp * pp * cp}")
        dp = world // (tp * pp * cp)
        bs = cfg.batch_sizes(dp)
        z, ac = cfg.zero_optimization, cfg.activation_checkpointing
        precision = "fp16" if cfg.fp16.enabled else "bf16" if cfg.bf16.enabled else "fp32"
        return cls(dp=dp, tp=tp, pp=pp, cp=cp, ep=cfg.expert_parallel.size, zero=z.stage,
                   micro_batch=bs.micro_batch, grad_accum=bs.grad_accum,
                   seq_len=cfg.data.seq_len, precision=precision, optimizer=cfg.optimizer.type,
                   checkpointing=ac.recompute_mode, recompute_ops=ac.recompute_ops, offload_blocks=ac.offloaded,
                   sequence_parallel=cfg.tensor_parallel.sequence_parallel, schedule=cfg.pipeline.schedule,
                   virtual_stages=cfg.pipeline.virtual_stages,
                   offload_optimizer=z.offload_optimizer.device if z.offload_optimizer else "none",
                   offload_param=z.offload_param.device if z.offload_param else "none",
                   pipeline_gather=z.stage3_pipeline_gather)
