"""DeepSpeed 0.19's keys, at every depth, of its sections that bunsan has no typed field for (deepspeed_only.py's
rows) or holds as one free-form mapping (data_efficiency.data_routing, a curriculum's schedule_config). Any
other key in them is unknown, whether the section is enabled, disabled or refused: DeepSpeed configs carry
disabled sections, and a typo in one would otherwise pass without a word. Transcribed from DeepSpeed's readers
(compression/config.py, runtime/data_pipeline/, autotuning/, elasticity/,
nebula/, compile/config.py, inference/config.py, runtime/config.py and constants.py, ...)."""

from __future__ import annotations

from bunsan.config.key_shapes import FREE, NAME, keys

AUTOTUNING = keys(
    "enabled", "fast", "results_dir", "exps_dir", "overwrite", "start_profile_step", "end_profile_step", "metric",
    "metric_path", "tuner_type", "tuner_early_stopping", "tuner_num_trials", "model_info_path", "mp_size",
    "max_train_batch_size", "min_train_batch_size", "max_train_micro_batch_size_per_gpu",
    "min_train_micro_batch_size_per_gpu", "num_tuning_micro_batch_sizes",
    arg_mappings=FREE,   # DeepSpeed key -> the training script's argument name
    model_info=keys("profile", "num_params", "hidden_size", "num_layers"))

# the same difficulty schedule in the legacy top-level section and in data_efficiency's curriculum metrics
SCHEDULE_CONFIG = keys("total_curriculum_step", "difficulty_step", "root_degree", "difficulty", "max_step")
CURRICULUM_LEARNING = keys("enabled", "curriculum_type", "min_difficulty", "max_difficulty", "schedule_type",
                           schedule_config=SCHEDULE_CONFIG)

DATA_ROUTING = keys("enabled", random_ltd=keys(
    "enabled", "total_layer_num", "random_ltd_layer_num", "random_ltd_layer_id", "model_mask_name", "model_type",
    "hidden_state_order",
    random_ltd_schedule=keys("min_value", "max_value", "schedule_type",
                             schedule_config=keys("seq_per_step", "require_steps")),
    layer_token_lr_schedule=keys("enabled", "total_layer_tokens", "warmup_type", "warmup_layer_tokens")))


def _technique(shared, *params: str):
    """A compression technique: its shared_parameters, and groups of the user's naming with their params."""
    group = keys("modules", "related_modules", params=keys(*params))
    return keys(shared_parameters=shared, different_groups={NAME: group})


_PRUNING = ("enabled", "method", "schedule_offset")
COMPRESSION_TRAINING = keys(
    weight_quantization=_technique(keys(
        "enabled", "quantizer_kernel", "schedule_offset", "quantize_groups", "quantize_verbose", "quantization_type",
        "quantize_weight_in_forward", "rounding", fp16_mixed_quantize=keys("enabled", "quantize_change_ratio")),
        "start_bits", "target_bits", "quantization_period"),
    activation_quantization=_technique(keys("enabled", "quantization_type", "range_calibration", "schedule_offset"),
                                       "bits"),
    sparse_pruning=_technique(keys(*_PRUNING, "block_pattern", "dense_ratio", "schedule_offset_stride",
                                   "excluded_modules", "schedule_offset_end"), "dense_ratio"),
    row_pruning=_technique(keys(*_PRUNING), "dense_ratio"),
    head_pruning=_technique(keys(*_PRUNING, "num_heads"), "dense_ratio"),
    channel_pruning=_technique(keys(*_PRUNING), "dense_ratio"),
    layer_reduction=keys("enabled", "keep_number_layer", "module_name_prefix", "teacher_layer", "other_module_name"))

ELASTICITY = keys("enabled", "max_train_batch_size", "micro_batch_sizes", "min_gpus", "max_gpus", "num_gpus_per_node",
                  "model_parallel_size", "min_time", "version", "prefer_larger_batch", "ignore_non_elastic_batch_info")
NEBULA = keys("enabled", "nebula_load_path", "enable_nebula_load", "persistent_storage_path",
              "persistent_time_interval", "num_of_version_in_retention")
# DeepSpeed passes every key but enabled to apex.amp.initialize: its keyword arguments
AMP = keys("enabled", "opt_level", "cast_model_type", "patch_torch_functions", "keep_batchnorm_fp32", "master_weights",
           "loss_scale", "cast_model_outputs", "num_losses", "verbosity", "min_loss_scale", "max_loss_scale")
TORCH_AUTOCAST = keys("enabled", "dtype", "lower_precision_safe_modules")
SPARSE_ATTENTION = keys(
    "mode", "block", "different_layout_per_head", "num_local_blocks", "num_global_blocks", "attention",
    "horizontal_global_attention", "num_different_global_patterns", "num_random_blocks", "local_window_blocks",
    "global_block_indices", "global_block_end_indices", "num_sliding_window_blocks")
PROGRESSIVE_LAYER_DROP = keys("enabled", "theta", "gamma")
EIGENVALUE = keys("enabled", "verbose", "max_iter", "tol", "stability", "gas_boundary_resolution", "layer_name",
                  "layer_num")
QUANTIZE_TRAINING = keys(   # MoQ (DeepSpeed 0.8's runtime/config.py), with the eigenvalue it reads inside
    "enabled", "quantizer_kernel", "quantize_groups", "quantize_verbose",
    quantize_bits=keys("start_bits", "target_bits"), quantize_schedule=keys("quantize_period", "schedule_offset"),
    fp16_mixed_quantize=keys("enabled", "quantize_change_ratio"), quantize_algo=keys("q_type", "rounding"),
    eigenvalue=EIGENVALUE)
WEIGHT_QUANTIZATION = keys("enabled", "num_bits", "q_type", "q_groups",
                           quantized_initialization=FREE,   # passed to the quantizer as it is
                           post_init_quant=FREE)            # module name -> its quantization
COMPILE = keys(
    "deepcompile", "free_activation", "free_activation_threshold", "offload_activation",
    "offload_activation_pin_memory", "offload_opt_states", "double_buffer", "symmetric_memory", "debug_log",
    "offload_parameters", "sync_before_reduce", "sync_after_reduce", "sync_before_allgather", "sync_after_allgather",
    "keep_int_input_tensors", "keep_all_input_tensors", "passes")
TIMERS = keys(throughput=keys("enabled", "synchronized"))

ZENFLOW = keys("topk_ratio", "select_strategy", "select_interval", "update_interval", "overlap_step", "offload",
               "auto_ratio", "full_warm_up_rounds", "pt_reserved_cores_perc")
ZEROPP_LOCO_PARAM = keys("err_beta", "reset_T")
LEAF_MODULE = keys("classes", "names", "name_suffixes")
CHECKPOINT_WRITER = keys("type", "decoupled", "io_buffer_size", "io_buffer_double", "show_statistics", "data_parallel",
                         "io_multiplier")
TP_CONFIG = keys("tp_size", "tp_grain_size", "mpu", "tp_group")   # tensor_parallel.tp (alias tensor_parallel)
PARTITION_CONFIG = keys("tp_size", "embedding_partition_dim", "lm_head_patterns", "use_default_specs", "strict_mode",
                        layer_specs=keys("patterns", "partition_type", "gather_output", "grad_allreduce", "shape",
                                         "partition_dim", "model_types"))   # a list of these
