"""DeepSpeed keys bunsan accepts but has no use for, each with the reason, and DeepSpeed's other spellings.

A DeepSpeed JSON config should load unchanged, so a DeepSpeed key that only tunes a mechanism bunsan does
differently (or does anyway) is accepted rather than refused. It must not pass silently: a config that sets
one to a non-default value gets one IgnoredKeyWarning per key and process (rank 0 only), naming the key and
the reason. Keys that promise a feature bunsan has not built are errors instead (root.py's UNIMPLEMENTED).
A key with a field is accepted-and-ignored only if it is in IGNORED (tests/test_config_explain.py checks no
code reads it); DeepSpeed's keys bunsan has no field for are in deepspeed_only.py's table.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

from bunsan.config.errors import Rule, show

# dotted key -> why bunsan does not act on it (one line each; `bunsan config --explain KEY` prints it)
IGNORED: dict[str, str] = {
    "data_efficiency.data_sampling.curriculum_learning.data_cluster_path":
        "where DeepSpeed's sampler writes its data clusters; the single-cluster metrics bunsan builds make none",
    "hybrid_engine.max_out_tokens": "the size of DeepSpeed's inference-kernel KV cache; the hybrid engine here "
                                    "generates with the model's own generate and cache",
    "hybrid_engine.inference_tp_size": "1 is the only size built (each rank generates with the whole weights); "
                                       "larger is an error",
    "hybrid_engine.release_inference_cache": "bunsan keeps no inference workspace between generate calls",
    "hybrid_engine.pin_parameters": "bunsan gathers ZeRO-3 weights for generation into its own unit buffers",
    "hybrid_engine.tp_gather_partition_size": "layers per gather for inference TP, which is not built "
                                              "(inference_tp_size 1)",
    "prescale_gradients":
        "bunsan's LM loss is divided by the global batch's token count before backward, so gradients enter the "
        "all-reduce already scaled; with a loss_fn they are divided by the data-parallel size after it",
    "zero_allow_untested_optimizer":
        "bunsan checks a client optimizer itself under ZeRO: elementwise ones (and Adafactor) step shards, any "
        "other is refused with the reason, so there is nothing to allow",
    "wall_clock_breakdown":
        "DeepSpeed's per-phase timing print; bunsan records tokens_per_s every steps_per_print steps and the "
        "share of step time spent waiting for communication in the summary instead",
    "zero_optimization.stage3_max_reuse_distance":
        "ZeRO-3 in bunsan releases a unit right after its forward and backward and prefetches only the next one "
        "(bounded by stage3_max_live_parameters), so there is no reuse window to size",
    "zero_optimization.stage3_gather_16bit_weights_on_model_save":
        "bunsan always gathers the whole weights when it saves a model (train's final/model.safetensors, "
        "export to Hugging Face), and checkpoints load on any layout, so there is nothing to switch on",
    "zero_optimization.offload_optimizer.buffer_count":
        "bunsan's NVMe optimizer swap reads and writes one sub-group's master weights and states at a time "
        "with plain positional I/O; it keeps no buffer pool to size (offload_param.buffer_count does act)",
    "zero_optimization.offload_optimizer.fast_init":
        "bunsan writes the initial master weights to the NVMe swap file once at start-up; there is no slow "
        "initialisation path to speed up",
    "activation_checkpointing.contiguous_memory_optimization":
        "arranges partitioned activations (partition_activations) in one buffer; bunsan does not partition "
        "activations, and its recompute keeps each block's input (selective: and its matmul outputs)",
    "activation_checkpointing.number_checkpoints":
        "sizes the buffer of contiguous_memory_optimization, which bunsan has no use for",
    "activation_checkpointing.synchronize_checkpoint_boundary":
        "a CUDA synchronize at each checkpoint boundary, for DeepSpeed's debugging; bunsan's recompute needs none",
    "activation_checkpointing.profile":
        "DeepSpeed's per-checkpoint timing log; bunsan does not time checkpointed blocks separately (the "
        "metric records give tokens_per_s and the pipeline timeline gives per-stage times)",
}

# DeepSpeed's other spellings of a key (its pydantic field names, older names) -> bunsan's key.
ALIASES: dict[str, str] = {
    "bfloat16": "bf16",  # DeepSpeed's older name of the section
    **{f"zero_optimization.{name}": f"zero_optimization.stage3_{name}" for name in (
        "prefetch_bucket_size", "param_persistence_threshold", "max_live_parameters", "max_reuse_distance",
        "gather_16bit_weights_on_model_save", "model_persistence_threshold", "module_granularity_threshold",
        "use_all_reduce_for_fetch_params", "allgather_sequential")},
    "zero_optimization.stage3_gather_fp16_weights_on_model_save":  # deprecated by DeepSpeed, still read
        "zero_optimization.stage3_gather_16bit_weights_on_model_save",
}


class IgnoredKeyWarning(UserWarning):
    """A DeepSpeed key from IGNORED set to a non-default value: accepted, and bunsan does not act on it."""


class OldSpellingWarning(UserWarning):
    """A DeepSpeed key in a form DeepSpeed deprecated: read as its current spelling, which the message names."""


_logged: set[str] = set()  # keys warned about in this process


def say_once(key: str, message: str, category: type[Warning]) -> None:
    """Warn about `key` once per process, on rank 0 only (torchrun's other ranks load the same config)."""
    if os.environ.get("RANK", "0") != "0" or key in _logged:
        return
    _logged.add(key)
    # explicit location: the caller's frame is pydantic's, and its source line would only add noise
    warnings.warn_explicit(message, category, "<bunsan config>", 0, module="bunsan.config")


def warn_ignored(key: str, value: Any, reason: str) -> None:
    say_once(key, f"config key {key}={show(value)} is accepted and ignored: {reason}", IgnoredKeyWarning)


def canonical(path: str) -> str:
    """bunsan's spelling of a dotted key (or of a key below an aliased section): bfloat16.enabled -> bf16.enabled."""
    for alias, key in ALIASES.items():
        if path == alias or path.startswith(alias + "."):
            return key + path[len(alias):]
    return path


def rename_aliases(data: Any) -> Any:
    """A copy of the raw config with DeepSpeed's other spellings renamed to bunsan's; both given is an error."""
    if not isinstance(data, dict):
        return data
    data = dict(data)
    for alias, key in ALIASES.items():
        *parents, old = alias.split(".")
        new = key.split(".")[-1]
        node = data
        for part in parents:   # copy the path down so the caller's dicts stay as they were
            if not isinstance(node.get(part), dict):
                break
            node[part] = dict(node[part])
            node = node[part]
        else:
            if old not in node:
                continue
            if new in node:
                raise Rule((alias, f"both {alias} (DeepSpeed's other spelling) and {key} are set; keep only {key}"))
            node[new] = node.pop(old)
    return data


def ignored_settings(cfg) -> list[tuple[str, Any]]:
    """(key, value) for each IGNORED key the config sets to something other than its default."""
    out = []
    for key in IGNORED:
        *parents, leaf = key.split(".")
        node = cfg
        for part in parents:
            node = getattr(node, part)
            if node is None:  # an optional section (offload_optimizer) that is not there
                break
        else:
            value = getattr(node, leaf)
            if value != type(node).model_fields[leaf].get_default(call_default_factory=True):
                out.append((key, value))
    return out


def log_ignored(cfg) -> None:
    """Warn once per process, on rank 0 only, about each IGNORED key the config sets."""
    for key, value in ignored_settings(cfg):
        warn_ignored(key, value, IGNORED[key])
