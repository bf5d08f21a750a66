"""Every key of DeepSpeed 0.19's config works, is accepted and ignored with its reason, or is an error naming
the feature bunsan lacks: no DeepSpeed key is 'unknown'. DeepSpeed's deprecated forms are read as their
current spelling, with a warning; Hugging Face's "auto" is an error that says why."""

from __future__ import annotations

import re
import warnings

import pytest

from bunsan.cli.main import main
from bunsan.config import deepspeed_keys
from bunsan.config.deepspeed_intake import OLD_FORMS, row_for
from bunsan.config.deepspeed_keys import ALIASES, IgnoredKeyWarning, OldSpellingWarning
from bunsan.config.deepspeed_only import TABLE, at_defaults, disabled, is_, never, nothing_enabled
from bunsan.config.explain import entries
from bunsan.config.root import Config, ConfigError

_Z = ["stage", "contiguous_gradients", "reduce_scatter", "reduce_bucket_size", "use_multi_rank_bucket_allreduce",
      "allgather_partitions", "allgather_bucket_size", "overlap_comm", "compute_grad_norm", "load_from_fp32_weights",
      "elastic_checkpoint", "offload_param", "offload_optimizer", "zenflow", "sub_group_size", "cpu_offload_param",
      "cpu_offload_use_pin_memory", "cpu_offload", "prefetch_bucket_size", "stage3_prefetch_bucket_size",
      "param_persistence_threshold", "stage3_param_persistence_threshold", "model_persistence_threshold",
      "stage3_model_persistence_threshold", "max_live_parameters", "stage3_max_live_parameters",
      "max_reuse_distance", "stage3_max_reuse_distance", "gather_16bit_weights_on_model_save",
      "stage3_gather_16bit_weights_on_model_save", "module_granularity_threshold",
      "stage3_module_granularity_threshold", "use_all_reduce_for_fetch_params",
      "stage3_use_all_reduce_for_fetch_params", "allgather_sequential", "stage3_allgather_sequential",
      "stage3_gather_fp16_weights_on_model_save", "ignore_unused_parameters", "legacy_stage1",
      "round_robin_gradients", "parameter_alignment", "zero_hpz_partition_size", "zero_quantized_weights",
      "zero_quantized_nontrainable_weights", "zero_quantized_gradients", "memory_efficient_linear",
      "pipeline_loading_checkpoint", "override_module_apply", "log_trace_cache_warnings", "enable_sanity_checks",
      "save_muon_momentum_buffer_in_memory", "leaf_module", "mics_shard_size", "mics_hierarchical_params_gather",
      "zeropp_loco_param", "cpu_offload_params"]
# DeepSpeed 0.19.8's keys: runtime/config.py's DeepSpeedConfig and the section models and getters it reads
# (zero/config.py, zero/offload_config.py, precision_config.py, monitor/config.py, comm/config.py,
# profiling/constants.py, swap_tensor/constants.py, model_checkpointing/constants.py, ...), section by section.
DEEPSPEED_019: dict[str, list[str]] = {
    "": ["train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
         "managed_gradient_accumulation", "steps_per_print", "dump_state", "disable_python_gc", "disable_allgather",
         "communication_data_type", "seq_parallel_communication_data_type", "prescale_gradients",
         "gradient_predivide_factor", "gradient_allreduce_op", "zero_optimization", "activation_checkpointing",
         "comms_logger", "tensorboard", "wandb", "csv_monitor", "comet", "gradient_clipping", "fp16", "bf16",
         "bfloat16", "torch_autocast", "optimizer", "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer",
         "scheduler", "flops_profiler", "wall_clock_breakdown", "memory_breakdown", "autotuning",
         "use_data_before_expert_parallelism", "hybrid_engine", "pipeline", "data_efficiency", "checkpoint",
         "data_types", "aio", "dataloader_drop_last", "log_level", "datastates_ckpt", "weight_quantization",
         "compile", "timers", "tensor_parallel", "expert_parallel", "vocabulary_size", "sequence_parallel_size",
         "allgather_size", "nebula", "compression_training", "amp", "quantize_training", "sparse_gradients",
         "eigenvalue", "sparse_attention", "elasticity", "graph_harvesting", "curriculum_learning",
         "progressive_layer_drop"],
    "zero_optimization": _Z,
    "zero_optimization.offload_param": ["device", "nvme_path", "buffer_count", "buffer_size", "max_in_cpu",
                                        "pin_memory"],
    "zero_optimization.offload_optimizer": ["device", "nvme_path", "buffer_count", "pin_memory", "pipeline_read",
                                            "pipeline_write", "fast_init", "ratio", "super_offload",
                                            "cpuadam_cores_perc"],
    "fp16": ["enabled", "auto_cast", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
             "consecutive_hysteresis", "min_loss_scale", "fp16_master_weights_and_grads"],
    "bf16": ["enabled", "immediate_grad_update", "check_grad_overflow", "bf16_master_weights_and_grads",
             "bf16_optimizer_states"],
    "activation_checkpointing": ["partition_activations", "number_checkpoints", "contiguous_memory_optimization",
                                 "synchronize_checkpoint_boundary", "profile", "cpu_checkpointing"],
    "optimizer": ["type", "params", "legacy_fusion"],
    "scheduler": ["type", "params"],
    "tensorboard": ["enabled", "output_path", "job_name"],
    "wandb": ["enabled", "group", "team", "project"],
    "csv_monitor": ["enabled", "output_path", "job_name"],
    "comet": ["enabled", "samples_log_interval", "project", "workspace", "api_key", "experiment_name",
              "experiment_key", "online", "mode"],
    "comms_logger": ["enabled", "prof_all", "prof_ops", "verbose", "debug"],
    "flops_profiler": ["enabled", "recompute_fwd_factor", "profile_step", "module_depth", "top_modules",
                       "detailed", "output_file"],
    "aio": ["block_size", "queue_depth", "intra_op_parallelism", "single_submit", "overlap_events", "use_gds",
            "thread_count"],
    "checkpoint": ["tag_validation", "load_universal", "use_node_local_storage", "parallel_write",
                   "checkpoint_serialization", "writer"],
    "data_types": ["grad_accum_dtype", "param_dtype", "buffer_dtype", "keep_in_fp32_modules"],
    "pipeline": ["stages", "partition", "seed_layers", "activation_checkpoint_interval", "pipe_partitioned",
                 "grad_partitioned", "use_reentrant"],
    "tensor_parallel": ["dtype", "autotp_size", "tp_overlap_comm", "vocab_parallel_lm_head",
                        "vocab_parallel_ce_backend", "tensor_parallel", "tp", "injection_policy_tuple",
                        "partition_config", "preset_model", "keep_module_on_host", "replace_with_kernel_inject",
                        "kernel_inject"],
    "timers": ["throughput"],
}


def how_handled(key: str) -> str | None:
    """'field', 'alias', 'table' or 'old form' for a DeepSpeed key; None if bunsan would call it unknown."""
    if key in entries():
        return "field"
    if key in ALIASES:
        return "alias"
    if key in OLD_FORMS:
        return "old form"
    found = row_for(key)
    if found and (found[0] == key or not found[1].keys or key[len(found[0]) + 1:].split(".")[0] in found[1].keys):
        return "table"
    return None


def test_every_deepspeed_key_is_handled():
    keys = [f"{s}.{k}" if s else k for s, ks in DEEPSPEED_019.items() for k in ks]
    unknown = [k for k in keys if how_handled(k) is None]
    assert not unknown, "DeepSpeed keys bunsan would call unknown: " + ", ".join(unknown)
    assert how_handled("zero_optimization.no_such_key") is None and how_handled("wandb.projet") is None


def test_a_config_of_every_section_at_deepspeeds_off_values_loads():
    cfg = Config.load({"wandb": {"enabled": False, "project": "p"}, "csv_monitor": {"enabled": False},
                       "comet": {"enabled": False}, "flops_profiler": {"enabled": False, "profile_step": 3},
                       "comms_logger": {"enabled": False}, "tensorboard": {"enabled": False},
                       "curriculum_learning": {"enabled": False},
                       "fp16": {"enabled": True, "fp16_master_weights_and_grads": False},
                       "zero_optimization": {"stage": 2, "zero_quantized_gradients": False}})
    assert cfg.to_dict() == Config.load({"fp16": {"enabled": True}, "zero_optimization": {"stage": 2}}).to_dict()


# -- each row of the table: its off value loads silently, its asking value is refused or said ---------
SPECIAL = {   # rows whose off test is a one-off: (off value, asking value)
    "weight_quantization": ({"enabled": False}, {}),
    "compile": ({"deepcompile": False}, {"deepcompile": True}),
    "checkpoint.tag_validation": ("warn", "Fail"),
}


def _other(v):
    return (not v if isinstance(v, bool) else v + 1 if isinstance(v, (int, float)) else
            {"x": 1} if isinstance(v, dict) else "x")


def _values(key: str, row) -> tuple:
    """(a value that leaves the row off, or ... if none does; a value that asks for the feature)."""
    if key in SPECIAL:
        return SPECIAL[key]
    off = row.off
    if isinstance(off, is_):
        return off.values[0], _other(off.values[0])
    if isinstance(off, at_defaults):
        first = next(iter(off.defaults))
        return {}, {first: _other(off.defaults[first])}
    if off is disabled:
        return {"enabled": False}, {"enabled": True}
    if off is nothing_enabled:
        return {"a": {"enabled": False}}, {"a": {"enabled": True}}
    assert off is never, f"{key}: add its values to SPECIAL"
    return ..., True


def _config(key: str, value=...) -> dict:
    """A config setting `key` to `value` (left out when ...), inside what it needs to be valid."""
    *parents, leaf = key.split(".")
    cfg = {"zero_optimization": {"stage": 3}}
    node = cfg
    for part in parents:
        node = node.setdefault(part, {"device": "cpu"} if part.startswith("offload_") else {})
    if value is not ...:
        node[leaf] = value
    return cfg


@pytest.fixture
def fresh_log(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(deepspeed_keys, "_logged", set())


@pytest.mark.parametrize("key", sorted(TABLE))
def test_a_row_off_loads_silently_and_asked_for_is_refused_or_said(key, fresh_log):
    row = TABLE[key]
    off, asking = _values(key, row)
    if off is not ...:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert Config.load(_config(key, off)).to_dict() == Config.load(_config(key)).to_dict()
    if row.refused:
        with pytest.raises(ConfigError) as info:
            Config.load(_config(key, asking))
        assert key in str(info.value) and row.why in str(info.value)
        assert re.search(r"\b(set|use|remove|name|sweep|generate)\b", row.why), "a refusal names the fix"
    else:
        with pytest.warns(IgnoredKeyWarning) as said:
            Config.load(_config(key, asking))
        assert any(key in str(w.message) and row.why in str(w.message) for w in said)


def test_unknown_keys_inside_a_deepspeed_section_are_unknown():
    with pytest.raises(ConfigError, match=r"unknown config key 'flops_profiler.profile_stp' \(did you mean "
                                          r"'flops_profiler.profile_step'\?\)"):
        Config.load({"flops_profiler": {"enabled": False, "profile_stp": 1}})


# -- DeepSpeed's deprecated forms ----------------------------------------------------------------
def test_zero_optimization_true_or_false_is_stage_1_or_0_with_a_warning(fresh_log):
    with pytest.warns(OldSpellingWarning, match=r"zero_optimization=true is DeepSpeed's deprecated form, read as "
                                                r"zero_optimization=\{\"stage\": 1, \"allgather_bucket_size\": 300000000"):
        cfg = Config.load({"zero_optimization": True, "allgather_size": 3e8})
    assert cfg.zero_optimization.stage == 1 and cfg.zero_optimization.allgather_bucket_size == 300_000_000
    with pytest.warns(OldSpellingWarning, match=r"\{\"stage\": 0\}"):
        assert Config.load({"zero_optimization": False}).zero_optimization.stage == 0
    with pytest.raises(ConfigError, match=r"allgather_size: is read only with the deprecated zero_optimization "
                                          r"true; set zero_optimization.allgather_bucket_size"):
        Config.load({"allgather_size": 5e8, "zero_optimization": {"stage": 1}})


def test_cpu_offload_switches_are_the_offload_sections(fresh_log):
    with pytest.warns(OldSpellingWarning) as said:
        cfg = Config.load({"zero_optimization": {"stage": 3, "cpu_offload": True, "cpu_offload_param": True,
                                                 "cpu_offload_use_pin_memory": True}})
    zero = cfg.zero_optimization
    assert (zero.offload_optimizer.device, zero.offload_optimizer.pin_memory) == ("cpu", True)
    assert (zero.offload_param.device, zero.offload_param.pin_memory) == ("cpu", True)
    assert len(said) == 2 and "offload_optimizer={\"device\": \"cpu\", \"pin_memory\": true}" in str(said[0].message)
    with pytest.warns(OldSpellingWarning, match="cpu_offload_params=true"):   # DeepSpeed 0.3's spelling
        old = Config.load({"zero_optimization": {"stage": 3, "cpu_offload_params": True}}).zero_optimization
    assert old.offload_param.device == "cpu" and not old.offload_param.pin_memory
    off = Config.load({"zero_optimization": {"stage": 2, "cpu_offload": False}}).zero_optimization
    assert off.offload_optimizer is None


def test_cpu_offload_conflicts_and_a_lone_pin_switch(fresh_log):
    with pytest.raises(ConfigError, match=r"zero_optimization.cpu_offload: both cpu_offload .* and "
                                          r"offload_optimizer are set; keep only offload_optimizer"):
        Config.load({"zero_optimization": {"stage": 2, "cpu_offload": True, "offload_optimizer": {"device": "cpu"}}})
    with pytest.raises(ConfigError, match=r"cpu_offload_param: both"):
        Config.load({"zero_optimization": {"stage": 3, "cpu_offload_param": False, "offload_param": {}}})
    with pytest.raises(ConfigError, match=r"cpu_offload: expected true/false, got 'yes'"):
        Config.load({"zero_optimization": {"stage": 2, "cpu_offload": "yes"}})
    with pytest.warns(IgnoredKeyWarning, match=r"cpu_offload_use_pin_memory=true is accepted and ignored: .*set "
                                               r"offload_optimizer.pin_memory"):
        Config.load({"zero_optimization": {"stage": 2, "cpu_offload_use_pin_memory": True}})


# -- optimizer and scheduler types DeepSpeed builds and bunsan does not -------------------------
@pytest.mark.parametrize("name,text", [
    ("Lion", "Lion is not built"),
    ("Muon", "Muon"), ("MuAdamW", "muP"), ("SparseAdam", "DeepSpeed builds torch.optim.SparseAdam"),
])
def test_optimizers_bunsan_lacks_say_what_to_use(name, text):
    with pytest.raises(ConfigError) as info:
        Config.load({"optimizer": {"type": name, "params": {"lr": 1e-3}}})
    msg = str(info.value)
    assert msg.startswith("optimizer.type: ") and text in msg and "AdamW" in msg


@pytest.mark.parametrize("name", ["RMSprop", "adagrad", "Adamax", "NAdam", "RAdam", "Adadelta", "ASGD", "Rprop"])
def test_torchs_elementwise_optimizers_build_from_the_config(name):
    cfg = Config.load({"optimizer": {"type": name, "params": {"lr": 1e-3}}})
    assert cfg.optimizer.type.lower() == name.lower()


@pytest.mark.parametrize("name,text", [("CosineAnnealingLR", "torch.optim.lr_scheduler.CosineAnnealingLR"),
                                       ("OneCycleLR", "torch.optim.lr_scheduler.OneCycleLR")])
def test_schedulers_bunsan_lacks_say_what_to_use(name, text):
    with pytest.raises(ConfigError, match=rf"scheduler.type: .*{text}.*WarmupCosineLR"):
        Config.load({"scheduler": {"type": name, "params": {}}})


def test_adam_params_deepspeed_refuses_or_bunsan_cannot_honour():
    with pytest.raises(ConfigError, match=r"optimizer.params.max_grad_norm: is not an optimizer parameter; set "
                                          r"the top-level gradient_clipping"):
        Config.load({"optimizer": {"type": "Adam", "params": {"lr": 1e-3, "max_grad_norm": 1.0}}})
    with pytest.raises(ConfigError, match=r"params.fp32_optimizer_states: false .* not built"):
        Config.load({"optimizer": {"type": "Adam", "params": {"fp32_optimizer_states": False}}})
    assert Config.load({"optimizer": {"type": "AdamW", "params": {"fp32_optimizer_states": True}}}).optimizer.params == {}


def test_fp16_master_weights_and_grads():
    assert Config.load({"fp16": {"enabled": True, "fp16_master_weights_and_grads": False}}).fp16.enabled
    with pytest.raises(ConfigError, match=r"fp16.fp16_master_weights_and_grads: true: bunsan keeps fp32 master "
                                          r"weights and gradients .* set it to false"):
        Config.load({"fp16": {"enabled": True, "fp16_master_weights_and_grads": True}})


def test_hugging_face_auto_is_an_error_that_says_why():
    with pytest.raises(ConfigError) as info:
        Config.load({"train_micro_batch_size_per_gpu": "auto", "gradient_clipping": "auto",
                     "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto"}},
                     "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": "auto"}},
                     "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": "auto"}})
    lines = str(info.value).splitlines()[1:]
    assert len(lines) == 6 and all("'auto' is the Hugging Face Trainer's placeholder" in line for line in lines)
    assert Config.load({"train": {"backend": "auto"}}).train.backend == "auto"   # bunsan's own "auto" stays


def test_override_of_a_refused_key_says_why():
    with pytest.raises(ConfigError, match=r"^wandb.enabled: Weights & Biases logging is not built"):
        Config.load().override({"wandb.enabled": "true"})


def test_explain_a_key_bunsan_has_no_field_for(capsys):
    assert main(["config", "--explain", "wandb.project"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("wandb (DeepSpeed's key; bunsan has no field for it)") and "an error when set" in out
    assert main(["config", "--explain", "zero_optimization.memory_efficient_linear"]) == 0
    assert "accepted and ignored when set" in capsys.readouterr().out
    assert main(["config", "--explain", "zero_optimization.cpu_offload"]) == 0
    assert "deprecated form of offload_optimizer" in capsys.readouterr().out
    assert main(["config", "--explain", "zero_optimization.model_persistence_threshold"]) == 0
    assert "stage3_model_persistence_threshold" in capsys.readouterr().out


def test_tensorboard_with_an_engine_stepped_by_hand_is_said(fresh_log):
    import bunsan
    from parity import tiny_model
    with pytest.warns(IgnoredKeyWarning, match=r"tensorboard.enabled=true is accepted and ignored: an engine you "
                                               r"step yourself writes no TensorBoard scalars"):
        bunsan.initialize(tiny_model(), {"train_batch_size": 2, "tensorboard": {"enabled": True}})
