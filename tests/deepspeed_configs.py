"""DeepSpeed configs shipped in microsoft/DeepSpeedExamples, as Python dicts (name -> config), for
tests/test_deepspeed_examples.py. Each is the file's content as DeepSpeed reads it (hjson: some files miss a
comma or have a trailing one), with its path in the repository above it; Hugging Face "auto" values are kept
as they are. Template placeholders (CONFIG_CL_MIN, ...) are filled with numbers, and the long module lists of
the compression and data-efficiency sections are cut short: neither changes what loading them says."""

CONFIGS: dict[str, dict] = {
    # training/alpaca-lora-zero3/ds_config.json
    "alpaca_lora_zero3": {
        "fp16": {"enabled": True, "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 8,
                 "hysteresis": 2, "min_loss_scale": 1},
        "optimizer": {"type": "Adam", "params": {"lr": 1e-4}},
        "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": False,
                              "offload_optimizer": {"device": "cpu", "pin_memory": True},
                              "offload_param": {"device": "cpu", "pin_memory": True}, "overlap_comm": False,
                              "contiguous_gradients": True, "sub_group_size": 1e8, "stage3_max_live_parameters": 2e8,
                              "stage3_max_reuse_distance": 2e8, "stage3_prefetch_bucket_size": 1e8,
                              "stage3_param_persistence_threshold": 1e5, "reduce_bucket_size": 1e7},
        "activation_checkpointing": {"partition_activations": False, "cpu_checkpointing": False,
                                     "contiguous_memory_optimization": False, "number_checkpoints": None,
                                     "synchronize_checkpoint_boundary": False, "profile": True},
        "gradient_clipping": 1.0, "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1,
        "steps_per_print": 2000000},
    # training/cifar/ds_config.json
    "cifar": {
        "train_batch_size": 16, "steps_per_print": 250,
        "optimizer": {"type": "Adam", "params": {"lr": 0.001, "betas": [0.8, 0.999], "eps": 1e-8,
                                                 "weight_decay": 3e-7}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.001,
                                                     "warmup_num_steps": 1000}},
        "gradient_clipping": 1.0, "prescale_gradients": False,
        "bf16": {"enabled": True, "bf16_master_weights_and_grads": False, "loss_scale": 0, "loss_scale_window": 500,
                 "hysteresis": 2, "min_loss_scale": 1, "initial_scale_power": 15},
        "fp16": {"enabled": False, "fp16_master_weights_and_grads": False, "loss_scale": 0, "loss_scale_window": 500,
                 "hysteresis": 2, "min_loss_scale": 1, "initial_scale_power": 15},
        "wall_clock_breakdown": False,
        "zero_optimization": {"stage": 0, "allgather_partitions": True, "reduce_scatter": True,
                              "allgather_bucket_size": 50000000, "reduce_bucket_size": 50000000, "overlap_comm": True,
                              "contiguous_gradients": True, "cpu_offload": False}},
    # cifar/ds_config_lamb.json
    "cifar_lamb": {
        "train_batch_size": 1024, "train_micro_batch_size_per_gpu": 16, "steps_per_print": 1000,
        "prescale_gradients": False,
        "optimizer": {"type": "Lamb", "params": {"lr": 5e-3, "weight_decay": 0.01, "bias_correction": False,
                                                 "max_coeff": 0.3, "min_coeff": 0.01}},
        "gradient_clipping": 1.0, "wall_clock_breakdown": False, "fp16": {"enabled": False, "loss_scale": 0}},
    # cifar/ds_config_onebitlamb.json
    "cifar_onebitlamb": {
        "train_batch_size": 1024, "train_micro_batch_size_per_gpu": 16, "steps_per_print": 1000,
        "prescale_gradients": False,
        "optimizer": {"type": "OneBitLamb", "params": {
            "lr": 5e-3, "weight_decay": 0.01, "bias_correction": False, "max_coeff": 0.3, "min_coeff": 0.01,
            "freeze_step": 1000, "cuda_aware": False, "comm_backend_name": "nccl", "coeff_beta": 0.9,
            "factor_max": 2.0, "factor_min": 0.5, "factor_threshold": 0.1}},
        "gradient_clipping": 1.0, "wall_clock_breakdown": False, "fp16": {"enabled": False, "loss_scale": 0}},
    # training/imagenet/config/ds_fp16_z1_config.json
    "imagenet_fp16_z1": {
        "train_batch_size": 256, "gradient_accumulation_steps": 1, "steps_per_print": 50,
        "optimizer": {"type": "Adam", "params": {"lr": 0.001, "betas": [0.8, 0.999], "eps": 1e-8,
                                                 "weight_decay": 3e-7}},
        "zero_optimization": {"stage": 1}, "zero_allow_untested_optimizer": True,
        "fp16": {"enabled": True, "auto_cast": True}, "gradient_clipping": 0, "prescale_gradients": False,
        "cuda_visible_devices": 0, "wall_clock_breakdown": False},
    # training/megatron/Megatron-LM-v1.1.5-ZeRO3/examples/ds_zero_stage_3_config.json
    "megatron_zero3": {
        "train_batch_size": 64, "gradient_accumulation_steps": 1, "steps_per_print": 1,
        "zero_optimization": {"stage": 3, "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
                              "stage3_prefetch_bucket_size": 1e7, "stage3_param_persistence_threshold": 1e5,
                              "reduce_bucket_size": 1e7, "contiguous_gradients": True},
        "gradient_clipping": 1.0,
        "fp16": {"enabled": True, "loss_scale": 0, "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1},
        "wall_clock_breakdown": True, "zero_allow_untested_optimizer": False},
    # training/megatron/Megatron-LM-v1.1.5-ZeRO3/examples/ds_zero_stage_3_config_release.json
    "megatron_zero3_release": {
        "train_batch_size": 64, "gradient_accumulation_steps": 1, "steps_per_print": 1,
        "zero_optimization": {"stage": 3, "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e8,
                              "stage3_param_persistence_threshold": 1e5, "stage3_prefetch_bucket_size": 5e7,
                              "contiguous_gradients": True, "cpu_offload": True, "cpu_offload_params": True,
                              "cpu_offload_use_pin_memory": True, "overlap_comm": True, "reduce_bucket_size": 90000000,
                              "sub_group_size": 4e8},
        "gradient_clipping": 1.0,
        "fp16": {"enabled": True, "loss_scale": 0, "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1},
        "wall_clock_breakdown": True, "zero_allow_untested_optimizer": False},
    # Megatron-LM-v1.1.5-ZeRO3/examples/ds_zero_stage_infinity_config.json
    "megatron_zero_infinity": {
        "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "steps_per_print": 1,
        "zero_optimization": {"stage": 3, "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e8,
                              "stage3_param_persitance_threshold": 1e5, "stage3_prefetch_bucket_size": 5e7,
                              "contiguous_gradients": True, "overlap_comm": True, "reduce_bucket_size": 90000000,
                              "sub_group_size": 1e8,
                              "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme_data", "buffer_count": 4,
                                                    "pipeline_read": False, "pipeline_write": False,
                                                    "pin_memory": True},
                              "offload_param": {"device": "nvme", "nvme_path": "/nvme_data", "max_in_cpu": 1,
                                                "pin_memory": True}},
        "gradient_clipping": 1.0,
        "fp16": {"enabled": True, "loss_scale": 1024, "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1},
        "wall_clock_breakdown": True, "zero_allow_untested_optimizer": False,
        "aio": {"block_size": 1048576, "queue_depth": 16, "single_submit": False, "overlap_events": True,
                "thread_count": 2}},
    # Megatron-LM-v1.1.5-ZeRO3/examples/ds_config.json
    "megatron_zero3_plain": {
        "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1, "steps_per_print": 10,
        "gradient_clipping": 1.0,
        "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 10, "loss_scale_window": 1000,
                 "hysteresis": 2, "min_loss_scale": 1},
        "wall_clock_breakdown": True},
    # Megatron-LM-v1.1.5-ZeRO3/curriculum_learning/ds_zero_stage_2_config_baseline.json
    "megatron_curriculum_baseline": {
        "train_batch_size": 512, "gradient_accumulation_steps": 1, "steps_per_print": 1,
        "zero_optimization": {"stage": 2, "allgather_partitions": True, "reduce_scatter": True,
                              "allgather_bucket_size": 50000000, "reduce_bucket_size": 50000000, "overlap_comm": True},
        "optimizer": {"type": "Adam", "params": {"lr": 0.00015, "max_grad_norm": 1.0, "betas": [0.9, 0.95]}},
        "gradient_clipping": 1.0,
        "fp16": {"enabled": True, "loss_scale": 0, "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1},
        "wall_clock_breakdown": False, "zero_allow_untested_optimizer": False},
    # Megatron-LM-v1.1.5-ZeRO3/curriculum_learning/ds_zero_stage_2_config_curriculum_fixed_linear.json (template)
    "megatron_curriculum_fixed_linear": {
        "train_batch_size": 512, "gradient_accumulation_steps": 1, "steps_per_print": 1,
        "zero_optimization": {"stage": 2, "allgather_partitions": True, "reduce_scatter": True,
                              "allgather_bucket_size": 50000000, "reduce_bucket_size": 50000000, "overlap_comm": True},
        "optimizer": {"type": "Adam", "params": {"lr": 0.00015, "max_grad_norm": 1.0, "betas": [0.9, 0.95]}},
        "gradient_clipping": 1.0,
        "fp16": {"enabled": True, "loss_scale": 0, "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1},
        "wall_clock_breakdown": False, "zero_allow_untested_optimizer": False,
        "curriculum_learning": {"enabled": True, "curriculum_type": "seqlen", "min_difficulty": 64,
                                "max_difficulty": 1024, "schedule_type": "fixed_linear",
                                "schedule_config": {"total_step": 15000, "difficulty_step": 8}}},
    # Megatron-LM/scripts/ds_config.json
    "megatron_scripts": {
        "train_batch_size": 16, "gradient_accumulation_steps": 1, "steps_per_print": 1, "zero_optimization": True,
        "optimizer": {"type": "Adam", "params": {"lr": 0.00015, "max_grad_norm": 1.0}},
        "fp16": {"enabled": True, "loss_scale": 0, "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1}},
    # Megatron-LM/scripts/ds_zero2_config.json
    "megatron_zero2": {
        "train_batch_size": 16, "gradient_accumulation_steps": 1, "steps_per_print": 1,
        "zero_optimization": {"stage": 2}, "optimizer": {"type": "Adam", "params": {"lr": 0.00015}},
        "gradient_clipping": 1.0,
        "fp16": {"enabled": True, "loss_scale": 0, "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1},
        "activation_checkpointing": {"partition_activations": True, "contiguous_memory_optimization": False},
        "wall_clock_breakdown": False},
    # Megatron-LM/scripts/ds_zero3_config.json
    "megatron_zero3_scripts": {
        "train_batch_size": 16, "gradient_accumulation_steps": 1, "steps_per_print": 1,
        "zero_optimization": {"stage": 3}, "optimizer": {"type": "Adam", "params": {"lr": 0.00015}},
        "gradient_clipping": 1.0,
        "fp16": {"enabled": True, "loss_scale": 0, "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1},
        "activation_checkpointing": {"partition_activations": True, "contiguous_memory_optimization": False},
        "wall_clock_breakdown": False},
    # Megatron-LM/scripts/ds_zero2_cpu_offload_config.json
    "megatron_zero2_cpu_offload": {
        "train_batch_size": 16, "gradient_accumulation_steps": 1, "steps_per_print": 1,
        "zero_optimization": {"stage": 2, "cpu_offload": True}, "optimizer": {"type": "Adam", "params": {"lr": 0.00015}},
        "gradient_clipping": 1.0,
        "fp16": {"enabled": True, "loss_scale": 0, "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1},
        "activation_checkpointing": {"partition_activations": True, "contiguous_memory_optimization": False},
        "wall_clock_breakdown": False},
    # Megatron-LM/scripts/ds_zerodual_config.json
    "megatron_zerodual": {
        "train_batch_size": 16, "gradient_accumulation_steps": 1, "steps_per_print": 1,
        "zero_optimization": {"stage": 2, "cpu_offload": True}, "zero_allow_untested_optimizer": True,
        "gradient_clipping": 1.0,
        "fp16": {"enabled": True, "loss_scale": 0, "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1},
        "activation_checkpointing": {"partition_activations": True, "contiguous_memory_optimization": True,
                                     "cpu_checkpointing": True},
        "wall_clock_breakdown": False},
    # Megatron-LM/scripts/ds_zero_stage_2_config.json
    "megatron_zero_stage_2": {
        "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "steps_per_print": 1,
        "zero_optimization": {"stage": 2, "allgather_partitions": True, "reduce_scatter": True,
                              "allgather_bucket_size": 500000000, "reduce_bucket_size": 500000000},
        "optimizer": {"type": "Adam", "legacy_fusion": False, "params": {"lr": 0.00015, "max_grad_norm": 1.0}},
        "fp16": {"enabled": True, "loss_scale": 0, "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1,
                 "initial_scale_power": 17},
        "wall_clock_breakdown": True},
    # Megatron-LM/scripts/ds_zero-offload_config.json
    "megatron_zero_offload": {
        "train_micro_batch_size_per_gpu": 12, "gradient_accumulation_steps": 5, "steps_per_print": 100,
        "optimizer": {"type": "DeepSpeed_Adam", "params": {"lr": 0.00015, "weight_decay": 1e-2}},
        "zero_optimization": {"stage": 2, "cpu_offload": True, "reduce_bucket_size": 50000000},
        "gradient_clipping": 1.0,
        "fp16": {"enabled": True, "loss_scale": 0, "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1},
        "activation_checkpointing": {"partition_activations": True, "contiguous_memory_optimization": True,
                                     "cpu_checkpointing": True},
        "wall_clock_breakdown": False},
    # Megatron-LM/model_size_test/ds_zero-offload_1B_config.json
    "megatron_zero_offload_1b": {
        "train_batch_size": 36, "gradient_accumulation_steps": 1, "steps_per_print": 1,
        "zero_optimization": {"stage": 2, "cpu_offload": True, "comm_overlap": True, "contiguous_gradients": True,
                              "reduce_bucket_size": 50000000},
        "optimizer": {"type": "Adam", "params": {"lr": 0.00015}}, "gradient_clipping": 1.0,
        "fp16": {"enabled": True, "loss_scale": 4096, "loss_scale_window": 1000, "hysteresis": 2,
                 "min_loss_scale": 1},
        "activation_checkpointing": {"partition_activations": True, "contiguous_memory_optimization": True,
                                     "cpu_checkpointing": True},
        "wall_clock_breakdown": False},
    # bing_bert/deepspeed_bsz64k_lamb_config_seq128.json
    "bing_bert_lamb_sparse_attention": {
        "train_batch_size": 65536, "train_micro_batch_size_per_gpu": 64, "steps_per_print": 100,
        "prescale_gradients": False,
        "optimizer": {"type": "Lamb", "params": {"lr": 11e-3, "weight_decay": 0.01, "bias_correction": False,
                                                 "max_coeff": 0.3, "min_coeff": 0.01}},
        "gradient_clipping": 1.0, "wall_clock_breakdown": False, "fp16": {"enabled": True, "loss_scale": 0},
        "sparse_attention": {"mode": "fixed", "block": 16, "different_layout_per_head": True, "num_local_blocks": 4,
                             "num_global_blocks": 1, "attention": "bidirectional",
                             "horizontal_global_attention": False, "num_different_global_patterns": 4}},
    # bing_bert/deepspeed_bsz4k_progressive_layer_drop_config_seq128.json
    "bing_bert_prescaled": {
        "train_batch_size": 4096, "train_micro_batch_size_per_gpu": 16, "steps_per_print": 1000,
        "prescale_gradients": True, "gradient_predivide_factor": 8,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "weight_decay": 0.01, "bias_correction": False}},
        "gradient_clipping": 1.0, "wall_clock_breakdown": False, "fp16": {"enabled": True, "loss_scale": 0}},
    # bing_bert/deepspeed_bsz4k_onebit_config_seq128.json
    "bing_bert_onebitadam": {
        "train_micro_batch_size_per_gpu": 16, "steps_per_print": 100, "prescale_gradients": False,
        "optimizer": {"type": "OneBitAdam", "params": {"lr": 4e-4, "weight_decay": 0.01, "bias_correction": False,
                                                       "freeze_step": 23000, "cuda_aware": True}},
        "gradient_clipping": 1.0, "wall_clock_breakdown": False, "fp16": {"enabled": True, "loss_scale": 0}},
    # training/bing_bert/01_adam/nccl/deepspeed_bsz4k_01adam_config_seq512_nccl.json
    "bing_bert_zerooneadam": {
        "train_batch_size": 4096, "train_micro_batch_size_per_gpu": 16, "steps_per_print": 100,
        "prescale_gradients": False,
        "optimizer": {"type": "ZeroOneAdam", "params": {
            "lr": 2.82e-5, "weight_decay": 0.01, "bias_correction": False, "var_freeze_step": 155000,
            "local_step_scaler": 32678, "cuda_aware": False, "comm_backend_name": "nccl"}},
        "gradient_clipping": 1.0, "wall_clock_breakdown": False,
        "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 16}},
    # bing_bert/deepspeed_bsz4096_adam_config.json
    "bing_bert_adam": {
        "train_batch_size": 4096, "train_micro_batch_size_per_gpu": 64, "steps_per_print": 1000,
        "optimizer": {"type": "Adam", "params": {"lr": 2e-4, "max_grad_norm": 1.0, "weight_decay": 0.01,
                                                 "bias_correction": False}},
        "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 16}},
    # training/BingBertGlue/glue_bert_large.json
    "bing_bert_glue_large": {
        "train_batch_size": 32, "train_micro_batch_size_per_gpu": 1, "steps_per_print": 10,
        "optimizer": {"type": "Adam", "params": {"lr": 2e-5, "weight_decay": 0.0, "bias_correction": True}},
        "gradient_clipping": 1.0, "fp16": {"enabled": False}},
    # training/BingBertSquad/1-bit_adam/mpi_infiniband/deepspeed_onebitadam_bsz96_config.json
    "bing_bert_squad_onebitadam": {
        "train_batch_size": 96, "train_micro_batch_size_per_gpu": 3, "steps_per_print": 100,
        "optimizer": {"type": "OnebitAdam", "params": {"lr": 3e-5, "freeze_step": 400, "weight_decay": 0.0,
                                                       "bias_correction": False, "cuda_aware": True,
                                                       "comm_backend_name": "mpi"}},
        "gradient_clipping": 1.0, "fp16": {"enabled": True}},
    # autotuning/hf/dsconfigs/ds_config_fp16_z2.json
    "autotuning_hf_fp16_z2": {"train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": 2},
                              "fp16": {"enabled": True}},
    # training/autotuning/hf/deberta/ds_config_fp16_tune.json
    "autotuning_deberta_tune": {
        "train_micro_batch_size_per_gpu": "auto", "fp16": {"enabled": True, "initial_scale_power": 12},
        "autotuning": {"enabled": True, "overwrite": False, "fast": True, "arg_mappings": {
            "train_micro_batch_size_per_gpu": "--per_device_train_batch_size",
            "gradient_accumulation_steps ": "--gradient_accumulation_steps"}}},
    # inference/huggingface/ds_config_cpu.json
    "hf_inference_cpu": {
        "fp16": {"enabled": True}, "bf16": {"enabled": False},
        "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 0, "stage3_max_reuse_distance": -1,
                              "_stage3_param_persistence_threshold": 1e9,
                              "offload_param": {"device": "cpu", "pin_memory": True}},
        "train_micro_batch_size_per_gpu": 1, "wall_clock_breakdown": False},
    # pipeline_parallelism/ds_config.json
    "pipeline_parallelism": {
        "train_batch_size": 256, "train_micro_batch_size_per_gpu": 16,
        "optimizer": {"type": "Adam", "params": {"lr": 0.001, "betas": [0.9, 0.999], "eps": 1e-8}},
        "steps_per_print": 10, "wall_clock_breakdown": False},
    # QANet-Pytorch/ds_bsz512_warmup.json
    "qanet_warmup": {
        "train_batch_size": 32, "steps_per_print": 10,
        "optimizer": {"type": "Adam", "params": {"lr": 0.001, "betas": [0.8, 0.999], "eps": 1e-8,
                                                 "weight_decay": 3e-7}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.001,
                                                     "warmup_num_steps": 1000}}},
    # QANet-Pytorch/ds_bsz512_1cycle.json
    "qanet_1cycle": {
        "train_batch_size": 512, "train_micro_batch_size_per_gpu": 32, "steps_per_print": 10,
        "optimizer": {"type": "Adam", "params": {"lr": 0.001, "betas": [0.8, 0.999], "eps": 1e-8,
                                                 "weight_decay": 3e-7}},
        "scheduler": {"type": "OneCycle", "params": {
            "cycle_min_lr": 0.004, "cycle_max_lr": 0.015, "cycle_first_step_size": 1000, "cycle_second_step_size": 100,
            "cycle_first_stair_count": 100, "cycle_second_stair_count": 100, "decay_step_size": 1000,
            "decay_lr_rate": 0.01}}},
    # MoQ/test.json
    "moq": {
        "steps_per_print": 10, "gradient_clipping": 1.0, "fp16": {"initial_scale_power": 16, "enabled": True},
        "quantize_training": {"enabled": True, "quantize_verbose": True, "quantizer_kernel": True,
                              "quantize_algo": {"q_type": "symmetric"},
                              "quantize_bits": {"start_bits": 16, "target_bits": 8},
                              "quantize_schedule": {"quantize_period": 400, "schedule_offset": 0},
                              "quantize_groups": 8}},
    # data_efficiency/gpt_finetuning/config/ds_config_gpt_base.json (random_ltd cut short)
    "data_efficiency_gpt_random_ltd": {
        "train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "steps_per_print": 2,
        "optimizer": {"type": "Adam", "params": {"lr": 0.0001, "betas": [0.8, 0.999], "eps": 1e-8,
                                                 "weight_decay": 3e-7}},
        "zero_optimization": {"stage": 0}, "fp16": {"enabled": False}, "gradient_clipping": 1.0,
        "prescale_gradients": True, "wall_clock_breakdown": False,
        "data_efficiency": {"enabled": True, "data_routing": {"enabled": True, "random_ltd": {
            "enabled": True, "total_layer_num": 12, "random_ltd_layer_num": 10, "model_type": "decoder"}}}},
    # compression/gpt2/config/ds_config_W8A8_Qgroup64_fp16.json (module lists cut short)
    "compression_gpt2_w8a8": {
        "train_batch_size": 8, "train_micro_batch_size_per_gpu": 4, "steps_per_print": 50,
        "optimizer": {"type": "Adam", "params": {"lr": 0.001, "betas": [0.8, 0.999], "eps": 1e-8,
                                                 "weight_decay": 3e-7}},
        "zero_optimization": {"stage": 0}, "fp16": {"enabled": True}, "gradient_clipping": 1.0,
        "prescale_gradients": True, "wall_clock_breakdown": False,
        "compression_training": {
            "weight_quantization": {"shared_parameters": {"enabled": True, "quantize_groups": 64},
                                    "different_groups": {"wq1": {"params": {"start_bits": 8, "target_bits": 8},
                                                                 "modules": ["attn.c_attn"]}}},
            "activation_quantization": {"shared_parameters": {"enabled": True, "range_calibration": "dynamic"},
                                        "different_groups": {"aq1": {"params": {"bits": 8},
                                                                     "modules": ["attn.c_attn"]}}}}},
    # compression/leap/ds_config.json
    "compression_leap": {
        "train_batch_size": 8, "train_micro_batch_size_per_gpu": 4, "steps_per_print": 50,
        "optimizer": {"type": "Adam", "params": {"lr": 0.001, "betas": [0.8, 0.999], "eps": 1e-8,
                                                 "weight_decay": 3e-7}},
        "zero_optimization": {"stage": 0}, "fp16": {"enabled": False}, "gradient_clipping": 1.0,
        "prescale_gradients": True, "wall_clock_breakdown": False},
    # applications/DeepSpeed-Chat/dschat/utils/ds_utils.py: get_train_ds_config(offload=True, dtype="bf16", stage=3)
    "deepspeed_chat_train": {
        "train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "steps_per_print": 10,
        "zero_optimization": {"stage": 3, "overlap_comm": True, "offload_param": {"device": "cpu"},
                              "offload_optimizer": {"device": "cpu"}, "stage3_param_persistence_threshold": 1e4,
                              "stage3_max_live_parameters": 3e7, "stage3_prefetch_bucket_size": 3e7,
                              "memory_efficient_linear": False},
        "bfloat16": {"enabled": True}, "gradient_clipping": 1.0, "prescale_gradients": False,
        "wall_clock_breakdown": False,
        "hybrid_engine": {"enabled": False, "max_out_tokens": 512, "inference_tp_size": 1,
                          "release_inference_cache": False, "pin_parameters": True, "tp_gather_partition_size": 8},
        "tensorboard": {"enabled": False, "output_path": "/step1_tensorboard/ds_tensorboard_logs/",
                        "job_name": "step1_model_tensorboard"}},
    # applications/DeepSpeed-Chat/dschat/utils/ds_utils.py: get_eval_ds_config(offload=False, dtype="fp16", stage=0)
    "deepspeed_chat_eval": {
        "train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "steps_per_print": 10,
        "zero_optimization": {"stage": 0, "stage3_param_persistence_threshold": 1e4,
                              "offload_param": {"device": "none"}, "memory_efficient_linear": False},
        "fp16": {"enabled": True}, "gradient_clipping": 1.0, "prescale_gradients": False,
        "wall_clock_breakdown": False},
}


def deepspeed_chat_configs() -> dict[str, dict]:
    """The configs DeepSpeed-Chat builds in Python (dschat/utils/ds_utils.py), one per case it can build: training
    (ZeRO stage x --offload x fp16/bf16 x hybrid engine: 32) and evaluation (stage x offload x dtype: 16), with the
    keys and values it writes (transcribed; batch sizes as its defaults)."""
    out = {}
    for stage in range(4):
        for offload in (False, True):
            device = "cpu" if offload else "none"
            for dtype in ("fp16", "bf16"):
                precision = {"fp16": {"enabled": True, "loss_scale_window": 100}} if dtype == "fp16" \
                    else {"bfloat16": {"enabled": True}}
                for hybrid in (False, True):
                    out[f"dschat_train_z{stage}_{'offload_' if offload else ''}{dtype}{'_hybrid' if hybrid else ''}"] = {
                        "train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "steps_per_print": 10,
                        "zero_optimization": {
                            "stage": stage, "overlap_comm": True, "offload_param": {"device": device},
                            "offload_optimizer": {"device": device}, "stage3_param_persistence_threshold": 1e4,
                            "stage3_max_live_parameters": 3e7, "stage3_prefetch_bucket_size": 3e7,
                            "memory_efficient_linear": False},
                        **precision, "gradient_clipping": 1.0, "prescale_gradients": False,
                        "wall_clock_breakdown": False,
                        "hybrid_engine": {"enabled": hybrid, "max_out_tokens": 512, "inference_tp_size": 1,
                                          "release_inference_cache": False, "pin_parameters": True,
                                          "tp_gather_partition_size": 8},
                        "tensorboard": {"enabled": False, "output_path": "/ds_tensorboard_logs/",
                                        "job_name": "step3_actor_tensorboard"}}
                out[f"dschat_eval_z{stage}_{'offload_' if offload else ''}{dtype}"] = {
                    "train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "steps_per_print": 10,
                    "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 1e4,
                                          "offload_param": {"device": device}, "memory_efficient_linear": False},
                    **({"fp16": {"enabled": True}} if dtype == "fp16" else {"bfloat16": {"enabled": True}}),
                    "gradient_clipping": 1.0, "prescale_gradients": False, "wall_clock_breakdown": False}
    return out
