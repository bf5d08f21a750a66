"""The DeepSpeed configs DeepSpeedExamples ships (tests/deepspeed_configs.py) load through Config.load, or fail
only where listed below, each with a message that names the key and what bunsan lacks (or the typo). Most
listed failures DeepSpeed 0.19 refuses as well; the reason says which."""

from __future__ import annotations

import warnings

import pytest

from bunsan.config.deepspeed_keys import ALIASES
from bunsan.config.root import Config, ConfigError
from deepspeed_configs import CONFIGS, deepspeed_chat_configs
from deepspeed_example_keys import EXAMPLE_KEYS
from test_deepspeed_keys import how_handled

# name -> (why it fails, {key of each error line: text the line must hold}); every other config loads
EXPECTED_FAILURES: dict[str, tuple[str, dict[str, str]]] = {
    "cifar": ("fp16's loss-scale keys under bf16, which has none (DeepSpeed 0.19 refuses them too)",
              {f"bf16.{k}": "unknown config key" for k in ("loss_scale", "loss_scale_window", "hysteresis",
                                                            "min_loss_scale", "initial_scale_power")}),
    "bing_bert_lamb_sparse_attention": ("sparse attention (DeepSpeed 0.19 removed it)",
                                        {"sparse_attention": "block-sparse attention is not built"}),
    "bing_bert_adam": ("max_grad_norm as an optimizer parameter (DeepSpeed 0.19 refuses it too)",
                       {"optimizer.params.max_grad_norm": "gradient_clipping"}),
    "megatron_curriculum_baseline": ("max_grad_norm (DeepSpeed 0.19 refuses it too)",
                                     {"optimizer.params.max_grad_norm": "gradient_clipping"}),
    "megatron_scripts": ("max_grad_norm (DeepSpeed 0.19 refuses it too)",
                         {"optimizer.params.max_grad_norm": "gradient_clipping"}),
    "megatron_zero_stage_2": ("max_grad_norm (DeepSpeed 0.19 refuses it too)",
                              {"optimizer.params.max_grad_norm": "gradient_clipping"}),
    "megatron_curriculum_fixed_linear": ("legacy curriculum learning (DeepSpeed 0.19 removed it), and total_step "
                                         "for total_curriculum_step (DeepSpeed's scheduler asserts on it too)",
                                         {"curriculum_learning": "curriculum learning is not built",
                                          "curriculum_learning.schedule_config.total_step":
                                          "did you mean 'curriculum_learning.schedule_config.total_curriculum_step'?"}),
    "megatron_zero_infinity": ("a typo, stage3_param_persitance_threshold (DeepSpeed 0.19 refuses it too)",
                               {"zero_optimization.stage3_param_persitance_threshold":
                                "did you mean 'zero_optimization.stage3_param_persistence_threshold'?"}),
    "megatron_zero_offload_1b": ("a typo, comm_overlap for overlap_comm (DeepSpeed 0.19 refuses it too)",
                                 {"zero_optimization.comm_overlap": "unknown config key"}),
    "megatron_zero_offload": ("optimizer DeepSpeed_Adam, which no DeepSpeed 0.19 builds either",
                              {"optimizer.type": "unknown optimizer 'DeepSpeed_Adam'"}),
    "hf_inference_cpu": ("stage3_max_reuse_distance -1 and an _-prefixed key (DeepSpeed 0.19 refuses both)",
                         {"zero_optimization.stage3_max_reuse_distance": "must be >= 0",
                          "zero_optimization._stage3_param_persistence_threshold": "did you mean"}),
    # Hugging Face's "auto": only the Trainer fills it in, and bunsan has none (DeepSpeed alone fails on it too)
    "autotuning_hf_fp16_z2": ("'auto' batch size", {"train_micro_batch_size_per_gpu": "Hugging Face Trainer's"}),
    "autotuning_deberta_tune": ("DeepSpeed's autotuner is not built",
                                {"autotuning": "autotuner"}),   # said before the "auto" batch size
    "moq": ("quantization-aware training (DeepSpeed 0.19 removed it)", {"quantize_training": "not built"}),
    "data_efficiency_gpt_random_ltd": ("random layer-token drop is not built",
                                       {"data_efficiency.data_routing": "random_ltd) is not built"}),
    "compression_gpt2_w8a8": ("the compression library (DeepSpeed 0.19 removed it)",
                              {"compression_training": "not built"}),
}
# name -> the not-built features bunsan.initialize would refuse (Config.unimplemented) in a config that loads
NOT_BUILT_AT_INITIALIZE: dict[str, list[str]] = {
    "megatron_zero2": ["activation_checkpointing.partition_activations"],
    "megatron_zero3_scripts": ["activation_checkpointing.partition_activations"],
    "megatron_zero2_cpu_offload": ["activation_checkpointing.partition_activations"],
    "megatron_zerodual": ["activation_checkpointing.partition_activations", "activation_checkpointing.cpu_checkpointing"],
}


def _load(cfg: dict) -> Config:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # the ignored keys and deprecated forms they use are said
        return Config.load(cfg)


def test_enough_configs_are_vendored():
    assert len(CONFIGS) >= 35 and set(EXPECTED_FAILURES) <= set(CONFIGS) and set(NOT_BUILT_AT_INITIALIZE) <= set(CONFIGS)


@pytest.mark.parametrize("name", sorted(set(CONFIGS) - set(EXPECTED_FAILURES)))
def test_config_loads(name):
    cfg = _load(CONFIGS[name])
    assert [m.split("=")[0] for m in cfg.unimplemented()] == NOT_BUILT_AT_INITIALIZE.get(name, [])
    assert Config.load(cfg.to_dict()) == cfg


@pytest.mark.parametrize("name", sorted(EXPECTED_FAILURES))
def test_config_fails_only_as_listed(name):
    _, want = EXPECTED_FAILURES[name]
    with pytest.raises(ConfigError) as info:
        _load(CONFIGS[name])
    lines = str(info.value).splitlines()
    lines = [line.strip() for line in lines[1:]] if len(lines) > 1 else lines
    got = {}
    for line in lines:
        key = line.split(":")[0] if not line.startswith("unknown config key") else line.split("'")[1]
        got[key] = line
    assert set(got) == set(want), f"{name}: {lines}"
    for key, text in want.items():
        assert text in got[key], f"{name}: {text!r} not in {got[key]!r}"


def test_configs_that_load_use_deepspeeds_forms_as_read():
    release = _load(CONFIGS["megatron_zero3_release"]).zero_optimization   # cpu_offload, cpu_offload_params
    assert release.offload_optimizer.device == release.offload_param.device == "cpu"
    assert release.offload_param.pin_memory   # cpu_offload_use_pin_memory
    chat = _load(CONFIGS["deepspeed_chat_train"])
    assert chat.bf16.enabled and chat.zero_optimization.stage3_max_live_parameters == 30_000_000
    qanet = _load(CONFIGS["qanet_warmup"]).scheduler
    assert qanet.type == "WarmupLR" and qanet.params["warmup_max_lr"] == 0.001


@pytest.mark.parametrize("name,raw", sorted(deepspeed_chat_configs().items()))
def test_every_config_deepspeed_chat_builds_loads_with_deepspeeds_meaning(name, raw):
    """DeepSpeed-Chat's --offload writes offload_param at every stage (DeepSpeed reads it at stage 3 only, and
    offload_optimizer from stage 1): below those stages the sections are dropped with a warning, as DeepSpeed
    ignores them; the hybrid engine is on where the config asks."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = Config.load(raw)
    stage, offload = raw["zero_optimization"]["stage"], raw["zero_optimization"]["offload_param"]["device"]
    zero = cfg.zero_optimization
    assert getattr(zero.offload_param, "device", "none") == ("cpu" if stage == 3 and offload == "cpu" else "none")
    if "offload_optimizer" in raw["zero_optimization"]:
        assert getattr(zero.offload_optimizer, "device", "none") == ("cpu" if stage >= 1 and offload == "cpu"
                                                                       else "none")
    assert cfg.hybrid_engine.enabled == raw.get("hybrid_engine", {}).get("enabled", False)
    assert cfg.bf16.enabled == ("bfloat16" in raw) and cfg.fp16.enabled == ("fp16" in raw)


def test_deepspeed_chat_builds_48_configs():
    assert len(deepspeed_chat_configs()) == 48


# sections whose inner keys bunsan reads as one value (refused when enabled, naming the section)
WHOLE_SECTIONS = {"data_efficiency.data_routing"}


def test_every_key_of_deepspeedexamples_configs_is_handled():
    """Each key of the 53 keys-only configs, and of every config DeepSpeed-Chat builds, acts, is ignored with its
    reason or is refused naming what bunsan lacks: none is 'unknown' (the values are tested above)."""
    chat = {name: _keys(raw) for name, raw in deepspeed_chat_configs().items()}
    every = {**EXAMPLE_KEYS, **chat}
    assert len(EXAMPLE_KEYS) == 53 and len(chat) >= 40 and len(every) >= 73
    unknown = {path: bad for path, keys in every.items()
               if (bad := [k for k in keys if how_handled(_current(k)) is None
                           and not k.startswith(tuple(WHOLE_SECTIONS))])}
    assert not unknown, unknown


def _current(key: str) -> str:
    """A key under a section's old name (bfloat16.enabled) as its current spelling (bf16.enabled)."""
    section, _, rest = key.partition(".")
    return f"{ALIASES[section]}.{rest}" if rest and section in ALIASES else key


def _keys(config: dict, prefix: str = "") -> list[str]:
    out = []
    for k, v in config.items():
        path = f"{prefix}.{k}" if prefix else k
        free = path.endswith(("optimizer.params", "scheduler.params"))
        out += _keys(v, path) if isinstance(v, dict) and v and not free else [path]
    return out
