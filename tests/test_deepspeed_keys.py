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
    """A value unlike v; a section's first key changed (its keys are checked, so none is made up)."""
    if isinstance(v, dict):
        return {k: _other(x) if i == 0 else x for i, (k, x) in enumerate(v.items())} if v else {"x": 1}
    return not v if isinstance(v, bool) else v + 1 if isinstance(v, (int, float)) else "x"


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
        return ({"weight_quantization": {"shared_parameters": {"enabled": False}}},
                {"weight_quantization": {"shared_parameters": {"enabled": True}}})
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


# -- unknown keys at every depth of every section, enabled, disabled or refused ------------------
def _refused(cfg: dict) -> str:
    with pytest.raises(ConfigError) as info:
        Config.load(cfg)
    return str(info.value)


@pytest.mark.parametrize("cfg, key, meant", [
    # DeepSpeed's AutoEP section, typed (enabled missing is DeepSpeed's false)
    ({"expert_parallel": {"size": 2}}, "expert_parallel.size", "expert_parallel.autoep_size"),
    ({"expert_parallel": {"enabled": False, "autoep_sise": 2}}, "expert_parallel.autoep_sise",
     "expert_parallel.autoep_size"),
    # depth 2: a typed section switched off, and a row at its defaults
    ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "none", "pin_memry": True}}},
     "zero_optimization.offload_optimizer.pin_memry", "zero_optimization.offload_optimizer.pin_memory"),
    ({"timers": {"throughput": {"enabld": True}}}, "timers.throughput.enabld", "timers.throughput.enabled"),
    # depth 3 and deeper inside disabled sections
    ({"quantize_training": {"enabled": False, "quantize_bits": {"start_bit": 16}}},
     "quantize_training.quantize_bits.start_bit", "quantize_training.quantize_bits.start_bits"),
    ({"autotuning": {"enabled": False, "model_info": {"num_param": 10}}}, "autotuning.model_info.num_param",
     "autotuning.model_info.num_params"),
    ({"compression_training": {"weight_quantization": {"shared_parameters": {"enabled": False,
                                                                            "quantize_group": 8}}}},
     "compression_training.weight_quantization.shared_parameters.quantize_group",
     "compression_training.weight_quantization.shared_parameters.quantize_groups"),
    ({"compression_training": {"head_pruning": {"different_groups": {"hp1": {"params": {"dense_ration": 0.5}}}}}},
     "compression_training.head_pruning.different_groups.hp1.params.dense_ration",
     "compression_training.head_pruning.different_groups.hp1.params.dense_ratio"),
    ({"data_efficiency": {"data_routing": {"enabled": False, "random_ltd": {"random_ltd_schedule": {
        "schedule_config": {"seq_per_stepp": 16}}}}}},
     "data_efficiency.data_routing.random_ltd.random_ltd_schedule.schedule_config.seq_per_stepp",
     "data_efficiency.data_routing.random_ltd.random_ltd_schedule.schedule_config.seq_per_step"),
    # inside a row refused whatever its value (the refusal is said too)
    ({"tensor_parallel": {"partition_config": None}, "zero_optimization": {"zenflow": None, "leaf_module": {
        "clases": ["MixtralSparseMoeBlock"]}}},
     "zero_optimization.leaf_module.clases", "zero_optimization.leaf_module.classes"),
])
def test_an_unknown_key_at_any_depth_of_a_section_is_named_with_its_whole_path(cfg, key, meant):
    msg = _refused(cfg)
    assert f"unknown config key '{key}' (did you mean '{meant}'?)" in msg


def test_an_unknown_key_in_a_section_bunsan_refuses_is_said_with_the_refusal():
    lines = _refused({"wandb": {"enabled": True, "projet": "p"}}).splitlines()
    assert "unknown config key 'wandb.projet' (did you mean 'wandb.project'?)" in lines[1]
    assert lines[2].strip().startswith("wandb: ") and TABLE["wandb"].why in lines[2]
    msg = _refused({"nebula": {"enabled": True, "persistent_storage_pth": "/x"}})
    assert "unknown config key 'nebula.persistent_storage_pth' (did you mean 'nebula.persistent_storage_path'?)" \
        in msg
    assert TABLE["nebula"].why in msg
    msg = _refused({"tensor_parallel": {"partition_config": {"layer_specs": [{"patterns": ["x"]}, {"pattern": "y"}]}}})
    assert "unknown config key 'tensor_parallel.partition_config.layer_specs[1].pattern' (did you mean " \
           "'tensor_parallel.partition_config.layer_specs[1].patterns'?)" in msg


def test_every_problem_of_a_config_is_said_at_once():
    lines = _refused({"flops_profiler": {"profile_stp": 2}, "data": {"fields": {"promt": "q"}},
                      "sparse_attention": {"mode": "fixed"}}).splitlines()
    assert lines[0] == "3 problems in the config:"
    assert {line.split("'")[1] for line in lines if "unknown config key" in line} == {"data.fields.promt",
                                                                                     "flops_profiler.profile_stp"}
    assert any(line.strip().startswith("sparse_attention: ") for line in lines)


def test_autoeps_model_injection_keys_are_refused_when_enabled_and_kept_quiet_when_off():
    """bunsan's expert parallelism splits its own MoE blocks: AutoEP's name patterns and presets, which would
    inject it into another model, are refused by name when the section is on; a switched-off section loads."""
    msg = _refused({"expert_parallel": {"enabled": True, "autoep_size": 2, "preset_model": "mixtral", "top_k": 2}})
    assert "expert_parallel.preset_model" in msg and "(preset_model, top_k)" in msg and "not built" in msg
    cfg = Config.load({"expert_parallel": {"enabled": False, "autoep_size": 2, "preset_model": "mixtral"}})
    assert cfg.expert_parallel.size == 1
    assert Config.load({"expert_parallel": {"enabled": True, "autoep_size": 4}}).expert_parallel.size == 4
    msg = _refused({"expert_parallel": {"enabled": True, "autoep_size": 2, "top_kk": 2}})
    assert "unknown config key 'expert_parallel.top_kk'" in msg


def test_a_disabled_section_with_deepspeeds_keys_loads():
    """Users' DeepSpeed configs carry sections they switched off, with all their keys: those load silently."""
    off = {
        "expert_parallel": {"enabled": False, "autoep_size": 4, "preset_model": "mixtral", "expert_w1": "w1",
                            "expert_w3": None, "top_k": "auto", "load_balance_coeff": None},
        "autotuning": {"enabled": False, "fast": True, "arg_mappings": {"train_micro_batch_size_per_gpu": "--bs"},
                       "model_info": {"profile": False, "num_params": 1000}},
        "quantize_training": {"enabled": False, "quantize_bits": {"start_bits": 16, "target_bits": 8},
                              "quantize_schedule": {"quantize_period": 400, "schedule_offset": 0},
                              "quantize_algo": {"q_type": "symmetric"}, "eigenvalue": {"enabled": False}},
        "compression_training": {
            "weight_quantization": {"shared_parameters": {"enabled": False, "quantize_groups": 64},
                                    "different_groups": {"wq1": {"params": {"start_bits": 8, "target_bits": 8},
                                                                 "modules": ["attn.c_attn"]}}},
            "layer_reduction": {"enabled": False, "keep_number_layer": 6, "teacher_layer": [1, 3, 5]}},
        "curriculum_learning": {"enabled": False, "curriculum_type": "seqlen", "schedule_type": "fixed_linear",
                                "schedule_config": {"total_curriculum_step": 100, "difficulty_step": 8}},
        "elasticity": {"enabled": False, "max_train_batch_size": 2000, "micro_batch_sizes": [2, 4]},
        "nebula": {"enabled": False, "persistent_storage_path": "/tmp"},
        "amp": {"enabled": False, "opt_level": "O1"},
        "torch_autocast": {"enabled": False, "dtype": "bfloat16"},
        "progressive_layer_drop": {"enabled": False, "theta": 0.5, "gamma": 0.001},
        "weight_quantization": {"enabled": False, "post_init_quant": {"fc": {"num_bits": 4}}},
        "compile": {"deepcompile": False, "offload_opt_states": True},
        "timers": {"throughput": {"enabled": True, "synchronized": True}},
        "data_efficiency": {"data_routing": {"enabled": False, "random_ltd": {
            "enabled": False, "total_layer_num": 12, "random_ltd_schedule": {
                "min_value": 128, "max_value": 2048, "schedule_type": "fixed_linear",
                "schedule_config": {"seq_per_step": 16, "require_steps": 100}}}}},
        "zero_optimization": {"stage": 3, "zenflow": None, "zeropp_loco_param": None,
                              "offload_optimizer": {"device": "none", "pin_memory": False}},
    }
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Config.load(off)


# rows whose DeepSpeed value is a mapping, besides those whose off test reads one (disabled, at_defaults, ...)
MAPPING_ROWS = ("weight_quantization", "compile", "sparse_attention", "datastates_ckpt", "zero_optimization.zenflow",
                "zero_optimization.zeropp_loco_param", "zero_optimization.leaf_module", "checkpoint.writer",
                "tensor_parallel.tp", "tensor_parallel.tensor_parallel", "tensor_parallel.partition_config")


def test_every_section_without_a_field_lists_its_keys():
    sections = [k for k, row in TABLE.items() if row.off in (disabled, nothing_enabled)
                or isinstance(row.off, at_defaults)] + list(MAPPING_ROWS)
    assert not [k for k in sections if not TABLE[k].keys], "sections whose keys go unchecked"


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
