"""DeepSpeed's sections of the config tree, one pydantic model each, with DeepSpeed's keys and defaults
(optimizer and scheduler are in optimizer_sections.py, bunsan's own sections in bunsan_sections.py). Every field has a one-line description
(`bunsan config --explain KEY` prints it). Cross-field rules raise Rule so the message names the
exact key (see config/errors.py)."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from bunsan.config.deepspeed_keys import warn_ignored
from bunsan.config.errors import Rule, show, suggest
from bunsan.models.blocks import SELECTIVE_OPS


def _whole(v: Any) -> Any:  # DeepSpeed writes sizes as 5e8, a float in JSON
    return int(v) if isinstance(v, float) and v.is_integer() else v


def _lower(v: Any) -> Any:
    return v.lower() if isinstance(v, str) else v


Int = Annotated[int, BeforeValidator(_whole)]
OptInt = Optional[Int]  # None = not set


def Choice(*names: str) -> Any:  # case-insensitive enum of strings
    return Annotated[Literal[names], BeforeValidator(_lower)]


Device = Choice("none", "cpu", "nvme")
Schedule = Choice("gpipe", "1f1b", "interleaved")
Partition = Choice("uniform", "parameters", "balanced")
GlooCollectives = Choice("shm", "exchange", "native")
Backend = Choice("auto", "nccl", "gloo")
RecomputeMode = Choice("none", "full", "selective")


def _blocks(v: Any) -> Any:  # a count of blocks, or "all"
    if isinstance(v, str) and v.lower() == "all":
        return "all"
    v = _whole(v)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise Rule(("", f"expected a count of blocks >= 0 or 'all', got {show(v)}; set it to one of those "
                        "(default 0)"))
    return v


Blocks = Annotated[Union[int, str], BeforeValidator(_blocks)]


class Section(BaseModel):
    # strict: no "yes" -> True or "10" -> 10 coercion; CLI strings are parsed in override()
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class FP16(Section):
    """float16 mixed precision with a dynamic loss scale; DeepSpeed's keys and meaning."""
    enabled: bool = Field(False, description="Cast the model to float16, keep fp32 master weights and scale the "
                                             "loss (DeepSpeed's meaning)")
    loss_scale: float = Field(0.0, ge=0, description="Static loss scale; 0 = dynamic scaling (DeepSpeed's meaning)")
    initial_scale_power: Int = Field(16, ge=0, le=64, description="Dynamic scaling starts at 2**this "
                                                                 "(DeepSpeed's meaning)")
    loss_scale_window: Int = Field(1000, ge=1, description="Steps without overflow before the dynamic scale doubles "
                                                           "(DeepSpeed's meaning)")
    hysteresis: Int = Field(2, ge=1, description="Overflowing steps absorbed before the dynamic scale halves "
                                                 "(DeepSpeed's meaning)")
    min_loss_scale: float = Field(1.0, gt=0, description="Floor of the dynamic scale; unlike DeepSpeed, an overflow "
                                                         "at the floor stops the run with an error")
    consecutive_hysteresis: bool = Field(False, description="Refill hysteresis after every step without overflow, "
                                                            "not only when the scale grows (DeepSpeed's meaning)")
    auto_cast: bool = Field(False, description="Cast floating-point positional forward inputs to float16 (DeepSpeed's "
                                               "meaning)")


class BF16(Section):
    """bfloat16 mixed precision; DeepSpeed's key and meaning (DeepSpeed's older name: bfloat16)."""
    enabled: bool = Field(False, description="Cast the model to bfloat16 and keep fp32 master weights; no loss "
                                             "scaling (DeepSpeed's meaning)")


class Offload(Section):
    """Where offloaded state lives; OffloadOptimizer and OffloadParam add their own keys."""
    device: Device = Field("none", description="Where the offloaded state lives: none, cpu (host memory) or nvme "
                                               "(a swap file under nvme_path) (DeepSpeed's meaning)")
    nvme_path: Optional[str] = Field(None, description="Directory on a fast local disk for the swap file; needed "
                                                       "with device nvme (DeepSpeed's meaning)")

    @model_validator(mode="after")
    def _nvme(self) -> Offload:
        if self.device == "nvme" and not self.nvme_path:
            raise Rule(("nvme_path", "device is 'nvme' but nvme_path is not set; set nvme_path to a directory "
                                     "on a local NVMe drive, or use device 'cpu'"))
        return self


class OffloadOptimizer(Offload):
    """ZeRO-Offload: fp32 master weights and optimizer states on the host or NVMe, stepped on the CPU."""
    pin_memory: bool = Field(False, description="Page-lock the host fp32 master weights (on a GPU) for faster "
                                                "copies to and from the device (DeepSpeed's meaning)")
    buffer_count: Int = Field(4, ge=1, description="DeepSpeed's NVMe buffer pool for optimizer states; accepted "
                                                   "and ignored (bunsan config --explain gives the reason)")
    fast_init: bool = Field(False, description="DeepSpeed's fast optimizer initialisation on NVMe; accepted and "
                                               "ignored (bunsan config --explain gives the reason)")


class OffloadParam(Offload):
    """ZeRO-3 parameter shards on the host or NVMe between uses."""
    pin_memory: bool = Field(False, description="Page-lock the host parameter shards (on a GPU) so host-to-device "
                                                "copies run asynchronously (DeepSpeed's meaning)")
    buffer_count: Int = Field(4, ge=1, description="With device nvme and pin_memory on a GPU: pinned buffers that "
                                                   "NVMe reads land in, used in turn (DeepSpeed's meaning)")


def offloads(o: Offload | None) -> bool:
    return o is not None and o.device != "none"


class Zero(Section):
    """ZeRO data parallelism: shards optimizer states (1), gradients (2) and parameters (3); DeepSpeed's section."""
    stage: Int = Field(0, ge=0, le=3, description="0 replicates (DDP); 1 shards optimizer states, 2 also gradients, "
                                                  "3 also parameters (DeepSpeed's meaning)")
    # DeepSpeed's default (5e8) puts a small model in one bucket, which cannot overlap backward; bunsan's is 1e7
    # (40 MB of fp32), near torch DDP's 25 MB.
    reduce_bucket_size: Int = Field(10_000_000, ge=1, description="Gradient elements per reduce bucket (DeepSpeed's "
                                                                  "meaning; default 1e7, not DeepSpeed's 5e8)")
    allgather_bucket_size: Int = Field(500_000_000, ge=1, description="ZeRO-1/2: most elements all-gathered at "
                                       "once after the step, as shards are stepped (DeepSpeed's meaning)")
    overlap_comm: bool = Field(True, description="Reduce gradient buckets while backward still runs "
                                                 "(DeepSpeed's meaning)")
    contiguous_gradients: bool = Field(True, description="Copy gradients into contiguous buckets (DeepSpeed's "
                                                         "meaning); bunsan always does, false is an error at stage 2-3")
    reduce_scatter: bool = Field(True, description="Average gradients with reduce-scatter; false: all-reduce and "
                                                   "keep this rank's slice (DeepSpeed's meaning)")
    allgather_partitions: bool = Field(True, description="Gather updated shards with all-gather (DeepSpeed's "
                                                         "meaning); false (DeepSpeed's broadcasts) is an error")
    stage3_prefetch_bucket_size: Int = Field(50_000_000, ge=0, description="ZeRO-3: 0 turns off prefetching the "
                                             "next unit; any other value prefetches it whatever its size")
    stage3_param_persistence_threshold: Int = Field(100_000, ge=0, description="ZeRO-3: units of at most this many "
                                                    "elements stay gathered (DeepSpeed's, per unit not per tensor)")
    stage3_max_live_parameters: Int = Field(1_000_000_000, ge=0, description="ZeRO-3: a prefetch waits while it would "
                                            "take the gathered elements past this (DeepSpeed's meaning)")
    stage3_max_reuse_distance: Int = Field(1_000_000_000, ge=0, description="DeepSpeed's ZeRO-3 reuse window in "
                                           "elements; accepted and ignored (bunsan config --explain gives the reason)")
    stage3_gather_16bit_weights_on_model_save: bool = Field(False, description="DeepSpeed: gather ZeRO-3 "
                                                            "weights in save_16bit_model; accepted and ignored "
                                                            "(bunsan always gathers whole weights to save)")
    sub_group_size: Int = Field(1_000_000_000, ge=1, description="Elements per optimizer sub-group, stepped (and "
                                                                 "swapped to NVMe) one at a time (DeepSpeed's meaning)")
    stage3_unit_modules: list[str] = Field(default_factory=list, description="bunsan: class names of the modules "
                                           "gathered as one ZeRO-3 unit; [] = the elements of model.layers")
    stage3_pipeline_gather: Literal["micro_batch", "schedule"] = Field(
        "micro_batch", description="bunsan, ZeRO-3 x pipeline: gather blocks per micro-batch (fwd and bwd) or once "
        "per step (schedule)")
    # Costs page faults; stage 1 never trims (see zero/stage12.py).
    trim_host_memory: bool = Field(True, description="bunsan, CPU only: return free heap pages to the OS during "
                                   "ZeRO-2/3 steps (malloc_trim), so resident memory follows what is held")
    offload_optimizer: Optional[OffloadOptimizer] = Field(None, description="ZeRO-Offload of master weights and "
                                                          "optimizer states, stage 1-3 (DeepSpeed's section)")
    offload_param: Optional[OffloadParam] = Field(None, description="ZeRO-3 offload of parameter shards "
                                                  "(DeepSpeed's section)")

    @model_validator(mode="after")
    def _offload_stage(self) -> Zero:
        # DeepSpeed reads offload_param at stage 3 only and offload_optimizer at stages 1-3, and ignores them
        # below (DeepSpeed-Chat's --offload sets both at every stage): the same config means the same run here
        if offloads(self.offload_param) and self.stage < 3:
            warn_ignored("zero_optimization.offload_param", self.offload_param.device,
                         f"parameters are sharded (and so offloaded) only at stage 3, this config has stage "
                         f"{self.stage}; DeepSpeed ignores it there too")
            self.offload_param = None
        if offloads(self.offload_optimizer) and self.stage < 1:
            warn_ignored("zero_optimization.offload_optimizer", self.offload_optimizer.device,
                         "ZeRO-Offload moves the sharded optimizer of stages 1-3, this config has stage 0; "
                         "DeepSpeed ignores it there too")
            self.offload_optimizer = None
        return self


class ActivationCheckpointing(Section):
    """Recompute activations in backward, or keep them in host memory; DeepSpeed's section plus bunsan's."""
    enabled: bool = Field(False, description="bunsan: recompute each block in backward (mode full); DeepSpeed "
                                             "checkpoints from model code instead")
    mode: Optional[RecomputeMode] = Field(None, description="bunsan: none, full (from each block's input) or "
                                          "selective (matmul outputs kept); unset: full if enabled")
    recompute: Optional[list[str]] = Field(None, description="bunsan, mode selective: which of attention (SDPA) "
                                           "and swiglu backward re-runs; unset = both")
    offload_blocks: Blocks = Field(0, description="bunsan: the first N blocks of each rank (or "
                                                  "all) keep their saved activations in host memory")
    partition_activations: bool = Field(False, description="Shard checkpointed activations over tensor-parallel "
                                                           "ranks (DeepSpeed's meaning); not built: true is an error")
    cpu_checkpointing: bool = Field(False, description="Move checkpointed activations to CPU memory (DeepSpeed's "
                                                       "meaning): with recompute on, every block's, as "
                                                       "offload_blocks all")
    contiguous_memory_optimization: bool = Field(False, description="DeepSpeed: one buffer for partitioned "
                                                 "activations; accepted and ignored (bunsan config --explain)")
    number_checkpoints: Optional[Int] = Field(None, ge=1, description="DeepSpeed: checkpoints that buffer is sized "
                                              "for; accepted and ignored (bunsan config --explain)")
    synchronize_checkpoint_boundary: bool = Field(False, description="DeepSpeed: CUDA synchronize at each "
                                                  "checkpoint; accepted and ignored (bunsan config --explain)")
    profile: bool = Field(False, description="DeepSpeed: time each checkpointed function; accepted and ignored "
                                             "(bunsan config --explain)")

    @property
    def recompute_mode(self) -> str:
        """none, full or selective: `mode`, else what `enabled` says."""
        return self.mode or ("full" if self.enabled else "none")

    @property
    def recompute_ops(self) -> tuple[str, ...]:
        """The ops selective recompute re-runs (models/blocks.py SELECTIVE_OPS by default)."""
        return SELECTIVE_OPS if self.recompute is None else tuple(self.recompute)

    @property
    def offloaded(self) -> int | str:
        """Blocks per rank whose saved activations go to host memory: a count, or "all" (cpu_checkpointing
        with recompute on; without, initialize refuses it: root.py UNIMPLEMENTED)."""
        return "all" if self.cpu_checkpointing and self.recompute_mode != "none" else self.offload_blocks

    @model_validator(mode="after")
    def _recompute(self) -> ActivationCheckpointing:
        if self.enabled and self.mode == "none":
            raise Rule(("mode", "enabled is true (recompute every block) but mode is 'none'; set mode to full "
                                "or selective, or enabled to false"))
        if self.recompute is not None:
            if self.recompute_mode != "selective":
                raise Rule(("recompute", f"recompute {show(self.recompute)} chooses what selective recompute "
                                         f"re-runs, but the mode is {self.recompute_mode}; set mode to "
                                         "selective or remove recompute"))
            unknown = [op for op in self.recompute if op not in SELECTIVE_OPS]
            if unknown or len(set(self.recompute)) != len(self.recompute):
                fix = suggest(str(unknown[0]), SELECTIVE_OPS) if unknown else "list each op once"
                raise Rule(("recompute", f"recompute {show(self.recompute)} must list distinct ops of "
                                         f"{list(SELECTIVE_OPS)}; {fix}"))
        if self.cpu_checkpointing and self.offload_blocks != 0:
            raise Rule(("offload_blocks", f"offload_blocks {show(self.offload_blocks)} with cpu_checkpointing "
                                          "true, which offloads every block; set one of them"))
        return self


class Tensorboard(Section):
    """The metric records also as TensorBoard scalars; DeepSpeed's section."""
    enabled: bool = Field(False, description="`bunsan train` writes its metric records as TensorBoard scalars (needs "
                                             "tensorboard); an engine you step yourself writes none")
    output_path: str = Field("", description="Directory of the event files; '' = train.output_dir/tensorboard "
                                             "(DeepSpeed's meaning)")
    job_name: str = Field("bunsan", description="Subdirectory of output_path for this run (DeepSpeed's meaning)")


class HybridEngine(Section):
    """DeepSpeed-Chat's hybrid engine: the trained model also generates (RLHF's actor); DeepSpeed's section."""
    enabled: bool = Field(False, description="The engine's model.generate runs on the training weights, gathered "
                                             "once per call under ZeRO-3 (bunsan.deepspeed engines)")
    max_out_tokens: Int = Field(512, ge=1, description="DeepSpeed: its inference kernels' KV-cache size; accepted "
                                "and ignored (generation uses the model's own cache)")
    inference_tp_size: Int = Field(1, ge=1, description="DeepSpeed: tensor-parallel degree while generating; only "
                                   "1 is built (each rank generates with the whole weights)")
    release_inference_cache: bool = Field(False, description="DeepSpeed: free the kernels' workspace after "
                                          "generating; accepted and ignored (nothing is kept between calls)")
    pin_parameters: bool = Field(True, description="DeepSpeed: pin the gathered weights; accepted and ignored")
    tp_gather_partition_size: Int = Field(8, ge=1, description="DeepSpeed: layers gathered at a time for "
                                          "inference TP; accepted and ignored (inference_tp_size is 1)")

    @model_validator(mode="after")
    def _built(self) -> HybridEngine:
        if self.enabled and self.inference_tp_size > 1:
            raise Rule(("inference_tp_size", f"{self.inference_tp_size}: tensor-parallel generation inside the "
                                             "hybrid engine is not built; set it to 1 (every rank generates with "
                                             "the whole weights), or use bunsan.deepspeed.init_inference"))
        return self
