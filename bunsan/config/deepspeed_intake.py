"""A raw DeepSpeed config made ready for the typed tree, before validation: DeepSpeed's deprecated forms read as
their current spelling (each with one OldSpellingWarning), its other spellings renamed (deepspeed_keys.ALIASES),
and the keys bunsan has no field for taken out (deepspeed_only.TABLE): dropped when off, said once when
ignored, an error when they ask for a feature bunsan does not have. Unknown keys inside those, and inside the
typed tree's free-form mappings (free_form_keys.py), are refused at every depth."""

from __future__ import annotations

import json
from typing import Any

from bunsan.config.deepspeed_keys import OldSpellingWarning, rename_aliases, say_once, warn_ignored
from bunsan.config.deepspeed_only import TABLE, DeepSpeedOnly, never
from bunsan.config.errors import Rule, show
from bunsan.config.free_form_keys import unknown_in_free_form
from bunsan.config.key_shapes import NAME, unknown_keys

_Z = "zero_optimization"
# DeepSpeed's deprecated keys whose value becomes another key's (`bunsan config --explain` prints these)
OLD_FORMS: dict[str, str] = {
    _Z: "true/false is DeepSpeed's deprecated form of {\"stage\": 1} / {\"stage\": 0}",
    "allgather_size": "with zero_optimization true: DeepSpeed's deprecated zero_optimization.allgather_bucket_size",
    f"{_Z}.cpu_offload": "true is DeepSpeed's deprecated form of offload_optimizer {\"device\": \"cpu\"}",
    f"{_Z}.cpu_offload_param": "true is DeepSpeed's deprecated form of offload_param {\"device\": \"cpu\"}",
    f"{_Z}.cpu_offload_params": "DeepSpeed 0.3's spelling of cpu_offload_param",
    f"{_Z}.cpu_offload_use_pin_memory": "with cpu_offload / cpu_offload_param: the pin_memory of the sections "
                                        "they stand for (DeepSpeed itself no longer reads it)",
}
# old switch -> the section it stands for
_OFFLOADS = {"cpu_offload": "offload_optimizer", "cpu_offload_param": "offload_param",
             "cpu_offload_params": "offload_param"}


def prepare(data: Any) -> Any:
    """The raw config as the typed tree reads it (the caller's dicts are not changed)."""
    if not isinstance(data, dict):
        return data
    data = rename_aliases(_old_zero(data))
    unknown = unknown_in_free_form(data)   # the typed tree's own mappings, checked here where the whole path is
    try:
        data = take_deepspeed_only(data)
    except Rule as e:   # every problem in one message
        raise Rule(*unknown, *e.problems) from None
    if unknown:
        raise Rule(*unknown)
    return data


def _old(key: str, value: Any, new: str, new_value: Any) -> None:
    say_once(f"{key}={show(value)}", f"config key {key}={show(value)} is DeepSpeed's deprecated form, read as {new}="
                  f"{json.dumps(new_value)}; write that instead", OldSpellingWarning)


def _old_zero(data: dict) -> dict:
    """zero_optimization true/false (with the top-level allgather_size) and its old cpu_offload switches."""
    data, zero = dict(data), data.get(_Z)
    if isinstance(zero, bool):
        new = {"stage": 1 if zero else 0}
        if zero and "allgather_size" in data:
            new["allgather_bucket_size"] = data.pop("allgather_size")
        elif "allgather_size" in data:
            warn_ignored("allgather_size", data.pop("allgather_size"), "zero_optimization is false")
        _old(_Z, zero, _Z, new)
        data[_Z] = new
    elif "allgather_size" in data:
        raise Rule(("allgather_size", "is read only with the deprecated zero_optimization true; set "
                                      "zero_optimization.allgather_bucket_size instead"))
    if isinstance(data.get(_Z), dict) and any(k in data[_Z] for k in (*_OFFLOADS, "cpu_offload_use_pin_memory")):
        data[_Z] = _old_offloads(dict(data[_Z]))
    return data


def _old_offloads(zero: dict) -> dict:
    """cpu_offload / cpu_offload_param(s) true -> offload_* {"device": "cpu"}, pinned by cpu_offload_use_pin_memory."""
    pin, problems, made = zero.pop("cpu_offload_use_pin_memory", None), [], []
    for old, section in _OFFLOADS.items():
        if old not in zero:
            continue
        on = zero.pop(old)
        if not isinstance(on, bool):
            problems.append((f"{_Z}.{old}", f"expected true/false, got {show(on)}; set it to true or false"))
        elif section in zero or section in made:
            problems.append((f"{_Z}.{old}", f"both {old} (DeepSpeed's deprecated form) and {section} are set; "
                                            f"keep only {section}"))
        elif on:
            zero[section] = {"device": "cpu", "pin_memory": bool(pin)}
            made.append(section)
            _old(f"{_Z}.{old}", on, f"{_Z}.{section}", zero[section])
    if problems:
        raise Rule(*problems)
    if pin is not None and not made:
        warn_ignored(f"{_Z}.cpu_offload_use_pin_memory", pin, "it pins only what cpu_offload / cpu_offload_param "
                     "offload (DeepSpeed no longer reads it at all); set offload_optimizer.pin_memory or "
                     "offload_param.pin_memory")
    return zero


# -- keys bunsan has no field for ----------------------------------------------------------------
def row_for(key: str) -> tuple[str, DeepSpeedOnly] | None:
    """The table row a dotted key falls under (its own, or its whole section's)."""
    parts = key.split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in TABLE:
            return ".".join(parts[:i]), TABLE[".".join(parts[:i])]
    return None


def _node(data: dict, path: list[str]) -> dict | None:
    for part in path:
        data = data.get(part)
        if not isinstance(data, dict):
            return None
    return data


def _without(data: dict, path: list[str], leaf: str) -> dict:
    """A copy of `data` without path.leaf, each level on the way copied so the caller's dicts stay as they were."""
    data = dict(data)
    node = data
    for part in path:
        node[part] = dict(node[part])
        node = node[part]
    del node[leaf]
    return data


def take_deepspeed_only(data: dict) -> dict:
    """`data` without the table's keys; Rule naming each that asks for what bunsan does not have, and each key
    inside them that DeepSpeed does not have (checked at every depth, whether the section is on or off)."""
    problems = []
    for key, row in TABLE.items():
        *path, leaf = key.split(".")
        node = _node(data, path)
        if node is None or leaf not in node:
            continue
        value = node[leaf]
        unknown = unknown_keys(key, value, row.keys)
        problems += unknown
        if not row.off(value) and row.refused:
            problems.append((key, f"{show(value)}: {row.why}"))
        elif not row.off(value) and not unknown:   # (not "accepted" when the load fails on its keys)
            warn_ignored(key, value, row.why)
        data = _without(data, path, leaf)
    if problems:
        raise Rule(*problems)
    return data


def explain_row(key: str) -> list[str] | None:
    """Lines for `bunsan config --explain KEY` when KEY is one bunsan has no field for; None otherwise."""
    if key in OLD_FORMS:
        return [f"{key} (DeepSpeed's deprecated form)", f"  {OLD_FORMS[key]}"]
    found = row_for(key)
    if found is None:
        return None
    name, row = found
    kind = "accepted and ignored when set: " if not row.refused else "not in bunsan, an error when set: "
    out = [f"{name} (DeepSpeed's key; bunsan has no field for it)", f"  {kind}{row.why}"]
    if row.off is not never:
        out.append("  accepted as it is when it leaves its feature off (enabled false, or DeepSpeed's default)")
    if named := [k for k in row.keys if k != NAME]:
        out.append(f"  its keys: {', '.join(named)}")
    return out
