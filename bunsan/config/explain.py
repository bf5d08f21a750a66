"""What every config key means, for `bunsan config --explain KEY` and `--list`: its dotted name, type,
default and one-line description, read from the pydantic models, plus what deepspeed_keys.py and root.py's
UNIMPLEMENTED say about it (accepted and ignored, or not built)."""

from __future__ import annotations

import difflib
import typing
from dataclasses import dataclass, field
from typing import Any, Iterator, Literal

from pydantic.fields import FieldInfo

from bunsan.config.deepspeed_keys import ALIASES, IGNORED, canonical
from bunsan.config.errors import ConfigError, field_bounds, is_model, show, unwrap
from bunsan.config.root import UNIMPLEMENTED, Config


@dataclass
class Entry:
    key: str                         # full dotted name
    field: FieldInfo
    section: type | None             # the model class when the key is a section
    ignored: str | None = None       # why bunsan accepts it and does not act on it
    not_built: str | None = None     # the rule under which it is an error
    aliases: list[str] = field(default_factory=list)

    @property
    def description(self) -> str:
        return self.field.description or ""

    @property
    def default(self) -> Any:
        return self.field.get_default(call_default_factory=True)


def walk(cls: type = Config, prefix: str = "") -> Iterator[tuple[str, FieldInfo, type | None]]:
    """(dotted key, field, section class or None) for every field below cls, sections before their keys."""
    for name, f in cls.model_fields.items():
        sub = unwrap(f.annotation)
        key = prefix + name
        yield key, f, sub if is_model(sub) else None
        if is_model(sub):
            yield from walk(sub, key + ".")


def entries() -> dict[str, Entry]:
    out = {key: Entry(key, f, sub, ignored=IGNORED.get(key)) for key, f, sub in walk()}
    for key, _, msg in UNIMPLEMENTED:
        if out[key].not_built is None:   # the first rule about a key is the one it is known by
            out[key].not_built = msg.split(": ", 1)[-1]
    for alias, key in ALIASES.items():
        if key in out:   # the others name keys bunsan has no field for (deepspeed_only.py)
            out[key].aliases.append(alias)
    return out


def type_name(f: FieldInfo) -> str:
    """The value a key takes, as a config file writes it: 'integer >= 1, or null'."""
    ann, nullable = unwrap(f.annotation), type(None) in typing.get_args(f.annotation)
    if typing.get_origin(ann) is Literal:
        text = "one of " + ", ".join(repr(c) for c in typing.get_args(ann))
    elif is_model(ann):
        text = "section"
    else:
        names = {bool: "true/false", int: "integer", float: "number", str: "string", list[str]: "list of strings",
                 dict[str, Any]: "mapping"}
        text = names.get(ann, getattr(ann, "__name__", str(ann)))
    bounds = field_bounds(f)
    return text + (f" {bounds}" if bounds else "") + (", or null" if nullable else "")


def find(key: str) -> tuple[Entry, str | None]:
    """The entry a key names (a DeepSpeed spelling or a unique last part works too), and the part of the key
    below a free-form mapping (optimizer.params.lr -> 'lr'), if any. ConfigError with a did-you-mean else."""
    table, key = entries(), key.strip()
    if canonical(key) in table:
        return table[canonical(key)], None
    for k, e in table.items():   # optimizer.params.lr: a key inside a mapping the optimizer type checks
        if key.startswith(k + ".") and typing.get_origin(unwrap(e.field.annotation)) is dict:
            return e, key[len(k) + 1:]
    leaf = sorted({canonical(k) for k in [*table, *ALIASES] if k.rsplit(".", 1)[-1] == key})
    if len(leaf) == 1:
        return table[leaf[0]], None
    if leaf:
        raise ConfigError(f"config key '{key}' is ambiguous: it ends {', '.join(leaf)}; give the full dotted name")
    close = difflib.get_close_matches(key, list(table) + list(ALIASES), n=1, cutoff=0.6)
    if not close:
        ends = {k.rsplit(".", 1)[-1]: k for k in table}
        close = [ends[c] for c in difflib.get_close_matches(key.rsplit(".", 1)[-1], list(ends), n=1, cutoff=0.6)]
    hint = f"did you mean '{canonical(close[0])}'?" if close else "bunsan config --list shows every key"
    raise ConfigError(f"unknown config key '{key}' ({hint})")


def line(e: Entry, width: int = 0) -> str:
    """One line: the key and its description."""
    return f"{e.key:<{width}}  {e.description}"


def explain(e: Entry, inner: str | None = None, value: Any = ..., asked: str = "") -> list[str]:
    """Lines describing one key (and, for a section, one line per key below it); `asked` is how the user
    spelled it, said when it is not bunsan's spelling."""
    out = [e.key + (" (section)" if e.section else ""), f"  {e.description}"]
    if inner is not None:
        out.append(f"  '{inner}' is a key inside {e.key}, checked against the type it goes with")
    elif asked and asked != e.key:
        deepspeed = canonical(asked) != asked or any(a.rsplit(".", 1)[-1] == asked for a in ALIASES)
        out.append(f"  '{asked}' is " + ("DeepSpeed's other spelling of it" if deepspeed else "the end of its name"))
    if e.section is None:
        out.append(f"  type: {type_name(e.field)}")
        out.append(f"  default: {show(e.default)}")
    if value is not ...:
        out.append(f"  value in the file: {show(value)}")
    if e.aliases:
        out.append(f"  also spelled: {', '.join(e.aliases)} (DeepSpeed)")
    if e.ignored:
        out.append(f"  accepted and ignored (bunsan/config/deepspeed_keys.py): {e.ignored}")
    if e.not_built:
        out.append(f"  not built, an error when set: {e.not_built}")
    if e.section is not None:
        below = [x for k, x in entries().items() if k.startswith(e.key + ".")]
        width = max(len(x.key) for x in below)
        out += ["  keys:"] + ["    " + line(x, width) for x in below]
    return out


def value_at(cfg: Config, key: str) -> Any:
    node: Any = cfg.to_dict()
    for part in key.split("."):
        if not isinstance(node, dict):
            return None
        node = node.get(part)
    return node
