"""The keys a raw mapping may hold, at every depth, for the parts of a config the typed tree does not check key
by key: DeepSpeed's sections bunsan has no field for (deepspeed_shapes.py) and the few free-form mappings of
the tree (data_efficiency.data_routing, a curriculum's schedule_config, data.fields). A typo there would
otherwise pass without a word, whether the section is enabled, disabled or refused."""

from __future__ import annotations

from typing import Any, Mapping, Optional, Union

from bunsan.config.errors import unknown_key

# key -> None (a value) or the shape of the mapping (or list of mappings) it holds
Shape = Mapping[str, Optional["Shape"]]
NAME = "*"            # a key the user chooses (a group's or a module's name), each holding NAME's shape
FREE: Shape = {NAME: None}   # names and values the user chooses: nothing to check


def keys(*values: str, **sections: Union[Shape, None]) -> dict[str, Optional[Shape]]:
    """A shape: keys holding a value, then keys holding a mapping of their own shape."""
    return {**dict.fromkeys(values), **sections}


def unknown_keys(path: str, value: Any, shape: Optional[Shape]) -> list[tuple[str, str]]:
    """(dotted key, message) for each key of `value`, at any depth, that `shape` does not have. Values of the
    wrong type are left to the checks that read them (a list where a mapping belongs says nothing here)."""
    if not shape:   # a value (None), or a row with no keys listed
        return []
    if isinstance(value, list):   # a list of sections (tensor_parallel.partition_config.layer_specs)
        return [p for i, item in enumerate(value) for p in unknown_keys(f"{path}[{i}]", item, shape)]
    if not isinstance(value, dict):
        return []
    named = [k for k in shape if k != NAME]
    out = []
    for k, v in value.items():
        where = f"{path}.{k}" if path else str(k)
        if k in shape:
            out += unknown_keys(where, v, shape[k])
        elif NAME in shape:
            out += unknown_keys(where, v, shape[NAME])
        else:
            out.append((where, unknown_key(where, str(k), named)))
    return out


def found_at(data: Any, pattern: str) -> list[tuple[str, Any]]:
    """(dotted key, value) of each place `pattern` names in raw `data`; a * part matches every key there."""
    places = [("", data)]
    for part in pattern.split("."):
        places = [(f"{path}.{k}" if path else str(k), v) for path, node in places if isinstance(node, dict)
                  for k, v in node.items() if part in (NAME, k)]
    return places
