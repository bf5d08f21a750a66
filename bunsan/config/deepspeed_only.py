"""DeepSpeed keys bunsan has no field for, each with the values that leave it off and what bunsan lacks or does
instead. With the typed tree and deepspeed_keys.IGNORED this covers every key of DeepSpeed 0.19's config:
a key works (a field), is accepted and ignored with its reason (IGNORED, or a row here with refused False),
or is an error that names the feature bunsan does not have (a row here).

A row's key set to a value that asks for nothing (a section with enabled false, a switch at its default) is
accepted and dropped before validation (deepspeed_intake.py), since a DeepSpeed config should load unchanged.
Set to ask for the feature it is an error, or, where ignoring it changes no result, one IgnoredKeyWarning.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from bunsan.config import deepspeed_shapes as shapes
from bunsan.config.key_shapes import Shape, keys


@dataclass(frozen=True)
class DeepSpeedOnly:
    why: str                            # what bunsan lacks (or does instead) and what to use
    off: Callable[[Any], bool]          # the values that ask for nothing: accepted and dropped
    refused: bool = True                # asked for: an error, or (False) accepted with an IgnoredKeyWarning
    keys: Shape = field(default_factory=dict)   # a section's DeepSpeed keys at every depth (deepspeed_shapes.py);
    #                                             any other key in it is unknown, enabled or not


def same(a: Any, b: Any) -> bool:
    """JSON equality that keeps true apart from 1 (and 1 equal to 1.0)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b


@dataclass(frozen=True)
class is_:   # noqa: N801 (reads as a predicate in the table: is_(False))
    """Off when the value is one of `values` (the first is DeepSpeed's default)."""
    values: tuple

    def __init__(self, *values: Any):
        object.__setattr__(self, "values", values)

    def __call__(self, v: Any) -> bool:
        return any(same(v, x) for x in self.values)


def disabled(v: Any) -> bool:
    """A section whose `enabled` is false or missing (DeepSpeed's default)."""
    return isinstance(v, dict) and v.get("enabled", False) is False


def never(v: Any) -> bool:
    return False


def nothing_enabled(v: Any) -> bool:
    """No `enabled: true` anywhere inside (each of DeepSpeed's compression techniques has its own)."""
    if isinstance(v, dict):
        return v.get("enabled", False) is False and all(nothing_enabled(x) for x in v.values())
    return not isinstance(v, list) or all(nothing_enabled(x) for x in v)


@dataclass(frozen=True)
class at_defaults:   # noqa: N801
    """Off when every key of the section is at DeepSpeed's default (`defaults`)."""
    defaults: dict

    def __init__(self, **d: Any):
        object.__setattr__(self, "defaults", d)

    def __call__(self, v: Any) -> bool:
        return isinstance(v, dict) and all(k in self.defaults and same(x, self.defaults[k]) for k, x in v.items())


def refuse(off, why: str, shape: Shape | None = None) -> DeepSpeedOnly:
    return DeepSpeedOnly(why, off, True, shape or {})


def ignore(off, why: str, shape: Shape | None = None) -> DeepSpeedOnly:
    return DeepSpeedOnly(why, off, False, shape or {})


def _section(refused: bool, why: str, **dflt: Any) -> DeepSpeedOnly:
    """A monitor or profiler section: off while not enabled; its keys are DeepSpeed's (defaults given)."""
    return DeepSpeedOnly(why, disabled, refused, keys("enabled", *dflt))


_SINKS = ("bunsan train writes the metric records to train.output_dir/metrics.jsonl (and TensorBoard scalars "
          "with tensorboard.enabled); set enabled false")
_OWN_LOOP = "bunsan's engine has no such mode; set it to false"
MONITORS = {
    "wandb": _section(True, "Weights & Biases logging is not built: " + _SINKS,
                      group=None, team=None, project="deepspeed"),
    "comet": _section(True, "Comet logging is not built: " + _SINKS, samples_log_interval=100, project=None,
                      workspace=None, api_key=None, experiment_name=None, experiment_key=None, online=None,
                      mode=None),
    "csv_monitor": _section(True, "CSV logging is not built: " + _SINKS, output_path="", job_name="DeepSpeedJobName"),
    "flops_profiler": _section(False, "DeepSpeed's per-module FLOPs print at profile_step; bunsan records "
                               "tokens_per_s and MFU in every metric record instead", recompute_fwd_factor=0.0,
                               profile_step=1, module_depth=-1, top_modules=1, detailed=True, output_file=None),
    "comms_logger": _section(False, "DeepSpeed's per-collective log; bunsan records each step's communicated "
                             "bytes (comm_bytes) and the share of step time spent waiting for it",
                             verbose=False, prof_all=True, prof_ops=[], debug=False),
    "timers": ignore(at_defaults(throughput={"enabled": True, "synchronized": True}),
                     "DeepSpeed's samples/s timer; bunsan times every step and records tokens_per_s",
                     shapes.TIMERS),
    "aio": ignore(at_defaults(block_size=1048576, queue_depth=8, intra_op_parallelism=1, thread_count=1,
                              single_submit=False, overlap_events=True, use_gds=False),
                  "DeepSpeed's async NVMe I/O tuning; bunsan's swap file uses plain positional reads and writes "
                  "(os.pread/os.pwrite), so there is nothing to tune",
                  keys("block_size", "queue_depth", "intra_op_parallelism", "thread_count", "single_submit",
                       "overlap_events", "use_gds")),
}

_REMOVED = " (DeepSpeed 0.19 removed it too)"
FEATURES = {
    "autotuning": refuse(disabled, "DeepSpeed's autotuner (trial launches over batch sizes and ZeRO stages) is "
                         "not built; `bunsan plan` ranks layouts by estimate; set enabled false", shapes.AUTOTUNING),
    "curriculum_learning": refuse(disabled, "curriculum learning is not built" + _REMOVED + "; set enabled false",
                                  shapes.CURRICULUM_LEARNING),
    "compression_training": refuse(nothing_enabled, "DeepSpeed's compression library (quantization, pruning, "
                                   "layer reduction) is not built" + _REMOVED + "; remove the section",
                                   shapes.COMPRESSION_TRAINING),
    "elasticity": refuse(disabled, "elastic training is not built" + _REMOVED + "; set train_batch_size and "
                         "train_micro_batch_size_per_gpu directly", shapes.ELASTICITY),
    "nebula": refuse(disabled, "Nebula checkpointing is not built" + _REMOVED + "; checkpoint.dir saves bunsan's "
                     "sharded checkpoints; set enabled false", shapes.NEBULA),
    "amp": refuse(disabled, "NVIDIA Apex AMP is not built" + _REMOVED + "; use bf16.enabled or fp16.enabled",
                  shapes.AMP),
    "torch_autocast": refuse(disabled, "torch.autocast mixed precision is not built; bf16.enabled or fp16.enabled "
                             "casts the model and keeps fp32 master weights; set enabled false", shapes.TORCH_AUTOCAST),
    "sparse_attention": refuse(never, "DeepSpeed's block-sparse attention is not built" + _REMOVED +
                               "; remove the section", shapes.SPARSE_ATTENTION),
    "sparse_gradients": refuse(is_(False), "sparse embedding-gradient reduction is not built" + _REMOVED +
                               "; set it to false"),
    "progressive_layer_drop": refuse(disabled, "progressive layer dropping is not built" + _REMOVED +
                                     "; set enabled false", shapes.PROGRESSIVE_LAYER_DROP),
    "graph_harvesting": refuse(is_(False), "CUDA-graph harvesting is not built" + _REMOVED + "; set it to false"),
    "eigenvalue": refuse(disabled, "eigenvalue-guided quantization is not built" + _REMOVED + "; set enabled false",
                         shapes.EIGENVALUE),
    "quantize_training": refuse(disabled, "quantization-aware training (MoQ) is not built" + _REMOVED +
                               "; set enabled false", shapes.QUANTIZE_TRAINING),
    "weight_quantization": refuse(lambda v: isinstance(v, dict) and v.get("enabled", True) is False,
                                  "DeepSpeed's weight quantization is not built; remove the section",
                                  shapes.WEIGHT_QUANTIZATION),
    "compile": refuse(lambda v: isinstance(v, dict) and not v.get("deepcompile", False), "DeepSpeed's "
                      "DeepCompile is not built; train.compile torch.compiles each transformer block; set "
                      "deepcompile false", shapes.COMPILE),
    "datastates_ckpt": refuse(is_(False, None), "DataStates asynchronous checkpointing is not built; "
                              "checkpoint.dir saves bunsan's sharded checkpoints; remove it",
                              shapes.FREE),   # handed to the datastates library as it is
    "sequence_parallel_size": refuse(is_(1), "DeepSpeed-Ulysses sequence parallelism is not built; "
                                     "context_parallel.size splits each row's tokens over ranks (K/V "
                                     "all-gathered), tensor_parallel.sequence_parallel shards activations "
                                     "between blocks; set it to 1"),
    "managed_gradient_accumulation": refuse(is_(True), "false (the caller owns the accumulation boundary) is "
                                            "not built: engine.step() steps every gradient_accumulation_steps-th "
                                            "call; set it to true"),
    "gradient_allreduce_op": refuse(is_("mean"), "bunsan averages gradients over data-parallel ranks; summing "
                                    "them is not built; set it to \"mean\""),
    "communication_data_type": refuse(is_(None), "bunsan reduces gradients in the model's dtype (bf16/fp16 "
                                      "with mixed precision, else fp32); another is not built; remove it"),
}

_WHY_TOP = {   # accepted and ignored: (DeepSpeed's default, the reason)
    "dump_state": (False, "DeepSpeed prints its engine's state after initialize; `bunsan config FILE` prints "
                          "the resolved config"),
    "memory_breakdown": (False, "DeepSpeed's memory print; bunsan adds every rank's measured memory to each "
                                "metric record (train.log_memory) and engine.memory_report()"),
    "disable_allgather": (False, "DeepSpeed 0.19 reads it nowhere"),
    "vocabulary_size": (None, "DeepSpeed only warns when it is not a multiple of 8; model.vocab_size sets "
                              "bunsan's"),
    "log_level": (None, "the level of DeepSpeed's logger; bunsan says what it does through warnings"),
    "disable_python_gc": (False, "bunsan leaves Python's garbage collector as it is"),
    "gradient_predivide_factor": (1.0, "bunsan's gradients are averaged over the global batch however the "
                                       "division is split around the all-reduce (see prescale_gradients)"),
    "zero_force_ds_cpu_optimizer": (True, "bunsan steps offloaded optimizer states on the CPU with the "
                                          "configured torch optimizer; there is no DeepSpeed CPU optimizer to force"),
    "use_data_before_expert_parallelism": (False, "orders expert-parallel groups; bunsan folds them over "
                                                   "the data-parallel ranks in rank order"),
    "cuda_visible_devices": (None, "DeepSpeed's config reads it nowhere (devices come from the launcher's "
                                   "CUDA_VISIBLE_DEVICES and LOCAL_RANK)"),
    "seq_parallel_communication_data_type": ("fp32", "the dtype of DeepSpeed-Ulysses' all-to-alls; bunsan "
                                                     "refuses sequence_parallel_size > 1"),
}
TOP = {k: ignore(is_(d), why) for k, (d, why) in _WHY_TOP.items()}

PRECISION = {
    "fp16.fp16_master_weights_and_grads": refuse(is_(False), "bunsan keeps fp32 master weights and gradients "
                                                 "(16-bit masters, DeepSpeed's ZeRO-2 + CPU Adam mode, are not "
                                                 "built); set it to false"),
    "bf16.bf16_master_weights_and_grads": refuse(is_(False), "bunsan keeps fp32 master weights and gradients; "
                                                 "bf16 masters are not built; set it to false"),
    "bf16.bf16_optimizer_states": refuse(is_(False), "bunsan keeps optimizer states in fp32 (AdamW8bit keeps "
                                         "8-bit moments); bf16 states are not built; set it to false"),
    "bf16.immediate_grad_update": ignore(is_(False), "when DeepSpeed's bf16 optimizer copies gradients into its "
                                         "fp32 copy; bunsan has no such wrapper: each ZeRO stage accumulates "
                                         "gradients in its one way"),
    "bf16.check_grad_overflow": ignore(is_(True), "bunsan always checks the gradient norm: a non-finite one "
                                       "without fp16 loss scaling stops the run with an error"),
}

_Z = "zero_optimization."
_NOT_ZERO_PP = "; bunsan's ZeRO gathers and reduces at full precision; set it to "
ZERO = {
    _Z + "zero_hpz_partition_size": refuse(is_(1), "ZeRO++ hierarchical partitioning (hpZ) is not built" +
                                           _NOT_ZERO_PP + "1"),
    _Z + "zero_quantized_weights": refuse(is_(False), "ZeRO++ quantized weight gathers (qwZ) are not built" +
                                          _NOT_ZERO_PP + "false"),
    _Z + "zero_quantized_nontrainable_weights": refuse(is_(False), "frozen weights stored quantized are not "
                                                       "built" + _NOT_ZERO_PP + "false"),
    _Z + "zero_quantized_gradients": refuse(is_(False), "ZeRO++ quantized gradient reduction (qgZ) is not built"
                                            + _NOT_ZERO_PP + "false"),
    _Z + "zenflow": refuse(is_(None), "ZenFlow (stepping important gradients first) is not built; remove it",
                           shapes.ZENFLOW),
    _Z + "mics_shard_size": refuse(is_(-1), "MiCS sub-group sharding is not built" + _REMOVED + "; remove it"),
    _Z + "mics_hierarchical_params_gather": refuse(is_(False), "MiCS is not built" + _REMOVED + "; remove it"),
    _Z + "zeropp_loco_param": refuse(is_(None), "LoCo-Zero++ is not built" + _REMOVED + "; remove it",
                                     shapes.ZEROPP_LOCO_PARAM),
    _Z + "leaf_module": refuse(never, "DeepSpeed's ZeRO-3 leaf modules; name bunsan's ZeRO-3 units with "
                                      "zero_optimization.stage3_unit_modules instead", shapes.LEAF_MODULE),
    _Z + "offload_optimizer.ratio": refuse(is_(1.0), "offloading part of the optimizer states is not built; "
                                                     "set it to 1 (offload all) or remove offload_optimizer"),
    _Z + "offload_optimizer.super_offload": refuse(is_(False), "SuperOffload (Grace-Hopper superchips) is not "
                                                               "built; set it to false"),
}

_ZERO_IGNORED = {   # zero_optimization.<key>: (DeepSpeed's default, the reason)
    "use_multi_rank_bucket_allreduce": (True, "bunsan reduces each bucket with one reduce-scatter (or all-reduce) "
                                              "over the data-parallel group"),
    "compute_grad_norm": (True, "bunsan needs the global gradient norm for clipping and for catching non-finite "
                                "gradients, so it always computes it"),
    "load_from_fp32_weights": (True, "bunsan's checkpoints hold the fp32 master weights and always restore from "
                                     "them"),
    "elastic_checkpoint": (False, "bunsan's checkpoints load on any layout (data-parallel size, ZeRO stage) anyway"),
    "stage3_model_persistence_threshold": (9223372036854775807, "bunsan keeps a ZeRO-3 unit gathered by its own "
                                           "size (stage3_param_persistence_threshold); there is no model-wide cap"),
    "stage3_module_granularity_threshold": (0, "bunsan's ZeRO-3 units are the blocks of model.layers (or "
                                               "stage3_unit_modules), not merged by size"),
    "stage3_use_all_reduce_for_fetch_params": (False, "bunsan gathers ZeRO-3 units with all-gather"),
    "stage3_allgather_sequential": (False, "bunsan gathers each ZeRO-3 unit with one all-gather into its flat "
                                           "buffer"),
    "ignore_unused_parameters": (True, "bunsan reduces the buckets of parameters that got no gradient after "
                                       "backward, as zeros; there is nothing to raise on"),
    "legacy_stage1": (False, "DeepSpeed's old ZeRO-1 code; bunsan has one ZeRO-1 (same result)"),
    "round_robin_gradients": (False, "DeepSpeed's gradient order for ZeRO-2 CPU offload; bunsan's buckets follow "
                                     "the parameter order"),
    "parameter_alignment": (False, "bunsan pads every bucket slice to 16 elements anyway"),
    "memory_efficient_linear": (True, "bunsan frees a ZeRO-3 unit's gathered weights after its forward and "
                                      "gathers them again for its backward, for every layer type"),
    "pipeline_loading_checkpoint": (False, "bunsan's checkpoints load on any layout"),
    "override_module_apply": (True, "DeepSpeed patches nn.Module.apply for zero.Init; bunsan patches no torch "
                                    "function"),
    "log_trace_cache_warnings": (False, "DeepSpeed's ZeRO-3 trace cache; bunsan's prefetch follows the unit order"),
    "enable_sanity_checks": (False, "DeepSpeed's internal ZeRO-3 debugging checks"),
    "save_muon_momentum_buffer_in_memory": (False, "for DeepSpeed's Muon, which bunsan does not build"),
}
_OFFLOAD_IGNORED = {   # zero_optimization.<key>: (DeepSpeed's default, the reason)
    "offload_optimizer.pipeline_read": (False, "bunsan's NVMe swap reads one sub-group at a time, not "
                                               "overlapped with the step"),
    "offload_optimizer.pipeline_write": (False, "bunsan's NVMe swap writes one sub-group at a time, not "
                                                "overlapped with the step"),
    "offload_optimizer.cpuadam_cores_perc": (0.8, "bunsan's CPU step uses torch's threads "
                                                  "(torch.set_num_threads)"),
    "offload_param.buffer_size": (100_000_000, "bunsan's NVMe reads land in buffers of each unit's own size "
                                               "(offload_param.buffer_count of them)"),
    "offload_param.max_in_cpu": (1_000_000_000, "bunsan keeps no parameter cache in host memory with NVMe "
                                                "offload: each unit is read when it is needed"),
}
ZERO.update({_Z + k: ignore(is_(d), why) for k, (d, why) in {**_ZERO_IGNORED, **_OFFLOAD_IGNORED}.items()})

DATA_TYPES = {
    "data_types": refuse(at_defaults(grad_accum_dtype=None, param_dtype=None, buffer_dtype=None,
                                     keep_in_fp32_modules="auto"),
                         "DeepSpeed's dtype overrides (gradient accumulation, parameters, buffers, fp32 modules) "
                         "are not built; bunsan's dtypes follow bf16/fp16 (a 16-bit model, fp32 master weights "
                         "and states); remove them",
                         keys("grad_accum_dtype", "param_dtype", "buffer_dtype", "keep_in_fp32_modules")),
}

CHECKPOINT = {
    "checkpoint.use_node_local_storage": refuse(is_(False), "bunsan saves to checkpoint.dir, which every rank must "
                                                "reach to resume on another layout; set it to false"),
    "checkpoint.tag_validation": ignore(lambda v: isinstance(v, str) and v.upper() == "WARN",
                                        "bunsan loads only a checkpoint all ranks "
                                        "finished writing, and checks its checksums; there are no tags to compare"),
    "checkpoint.load_universal": ignore(is_(False), "bunsan's checkpoints load on any layout already"),
    "checkpoint.parallel_write": ignore(at_defaults(pipeline_stage=False), "every bunsan rank writes only the "
                                        "pieces it steps, in parallel, whatever its pipeline stage",
                                        keys("pipeline_stage")),
    "checkpoint.checkpoint_serialization": ignore(is_(True), "torch.save's format switch; bunsan writes "
                                                  "safetensors"),
    "checkpoint.writer": ignore(is_(None), "DeepSpeed's fast checkpoint writer; bunsan writes safetensors with "
                                "plain file I/O", shapes.CHECKPOINT_WRITER),
}

_DS_PIPE = ("DeepSpeed's PipelineModule/PipelineEngine setting; bunsan's pipeline takes stages, schedule, "
            "virtual_stages and partition; remove it")
_DS_TP = ("DeepSpeed's AutoTP setting; bunsan's tensor parallelism is tensor_parallel.size (and "
          "sequence_parallel), over its Llama or a tp_plan passed to bunsan.initialize; remove it")
_TP_SHAPES = {"tp": shapes.TP_CONFIG, "tensor_parallel": shapes.TP_CONFIG, "partition_config": shapes.PARTITION_CONFIG}
PARALLEL = {
    "pipeline.activation_checkpoint_interval": refuse(is_(0), "checkpointing every n-th pipeline layer is not "
                                                      "built; activation_checkpointing.enabled recomputes every "
                                                      "block; set it to 0"),
    **{f"pipeline.{k}": refuse(never, _DS_PIPE) for k in (
        "seed_layers", "pipe_partitioned", "grad_partitioned", "use_reentrant")},
    **{f"tensor_parallel.{k}": refuse(never if d is ... else is_(d), _DS_TP, _TP_SHAPES.get(k)) for k, d in {
        "autotp_size": 0, "tp_overlap_comm": False, "keep_module_on_host": False, "replace_with_kernel_inject":
        False, "kernel_inject": False, "vocab_parallel_lm_head": None, "vocab_parallel_ce_backend": "torch",
        "injection_policy_tuple": None, "partition_config": None, "preset_model": None, "tp": {},
        "tensor_parallel": {}, "dtype": ...}.items()},
}

OPTIMIZER = {
    "optimizer.legacy_fusion": ignore(is_(False), "DeepSpeed's old fused-Adam fp16 path; bunsan's fp16 steps "
                                      "torch's optimizer on fp32 master weights"),
}

TABLE: dict[str, DeepSpeedOnly] = {**MONITORS, **FEATURES, **TOP, **PRECISION, **ZERO, **DATA_TYPES, **CHECKPOINT,
                                   **PARALLEL, **OPTIMIZER}

# optimizer.type values DeepSpeed builds and bunsan does not (lower-case -> why, and what to use instead)
OPTIMIZERS_NOT_BUILT: dict[str, str] = {
    "lion": "Lion is not built; use AdamW (Lion's lr is typically 3-10x lower than AdamW's)",
    "muon": "Muon is not built; use AdamW",
    **{k.lower(): f"{k} (the mup package's muP optimizer) is not built; use AdamW or SGD"
       for k in ("MuAdam", "MuAdamW", "MuSGD")},
}
