"""Config error messages: pydantic's ValidationError -> lines that name the key, the
value, the rule and the fix. Kept apart from config.py so the schema stays readable."""

from __future__ import annotations

import difflib
import json
import types
import typing
from typing import Any

import pydantic
from pydantic.fields import FieldInfo


class ConfigError(ValueError):
    """Every config problem; one line per problem, each naming the key and the fix."""


class Rule(ValueError):
    """Raised inside validators: problems as (key relative to the section, message)."""

    def __init__(self, *problems: tuple[str, str]):
        super().__init__("; ".join(m for _, m in problems))
        self.problems = list(problems)


def _cut(v: Any, depth: int = 2) -> Any:
    """A small copy of v to print: a few items, two levels, short strings (a value can be huge)."""
    if isinstance(v, str):
        return v if len(v) <= 40 else v[:40] + "..."
    if isinstance(v, dict):
        items = list(v.items())
        out = {str(k)[:40]: (_cut(x, depth - 1) if depth else "...") for k, x in items[:4]}
        return out | ({"...": f"{len(items) - 4} more"} if len(items) > 4 else {})
    if isinstance(v, (list, tuple)):
        out = [_cut(x, depth - 1) if depth else "..." for x in v[:4]]
        return out + ([f"... {len(v) - 4} more"] if len(v) > 4 else [])
    return v


def show(v: Any) -> str:
    """A value as the user wrote it (JSON-ish), cut short before it is serialised."""
    if isinstance(v, bool) or v is None:
        r = json.dumps(v)
    elif isinstance(v, (dict, list, tuple)):
        r = json.dumps(_cut(v), default=str)
    else:
        r = repr(_cut(v))
    return r if len(r) <= 60 else r[:57] + "..."


def suggest(name: str, choices: typing.Iterable[str], prefix: str = "") -> str:
    """'did you mean ...?' when something is close, else the list of valid names."""
    choices = list(choices)
    lower = {c.lower(): c for c in choices}
    name = str(name).lower()
    close = (_by_words(name, lower, lambda mine, theirs: mine <= theirs)
             or difflib.get_close_matches(name, list(lower), n=1, cutoff=0.6)
             or _by_words(name, lower, lambda mine, theirs: theirs <= mine))
    if close:
        return f"did you mean '{prefix}{lower[close[0]]}'?"
    return "valid: " + (", ".join(choices) if choices else "(none)")


def _by_words(name: str, lower: typing.Iterable[str], fits: typing.Callable[[set, set], bool]) -> list[str]:
    """The closest choice whose words (split at _) fit name's: a key missing its section's prefix (size for
    autoep_size, total_step for total_curriculum_step) is too short for difflib's ratio, or nearer another."""
    mine = set(name.split("_")) - {""}
    near = [c for c in lower if mine and fits(mine, set(c.split("_")) - {""})]
    return sorted(near, key=lambda c: -difflib.SequenceMatcher(None, name, c).ratio())[:1]


def dotted(loc: typing.Iterable[Any]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def unwrap(ann: Any) -> Any:
    """Optional[X] / Annotated[X, ...] -> X."""
    origin = typing.get_origin(ann)
    if origin is typing.Annotated:
        return unwrap(typing.get_args(ann)[0])
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in typing.get_args(ann) if a is not type(None)]
        return unwrap(rest[0]) if len(rest) == 1 else ann
    return ann


def is_model(cls: Any) -> bool:
    return isinstance(cls, type) and issubclass(cls, pydantic.BaseModel)


def unknown_key(path: str, name: str, valid: list[str]) -> str:
    parent = path[: -len(name)]  # keep the section prefix in the suggestion
    hint = suggest(name, valid, parent)
    return f"unknown config key '{path}' ({hint})" if hint.startswith("did") else (
        f"unknown config key '{path}'; remove it or use one of: {', '.join(valid)}")


def lookup(root: type, parts: list[str]) -> FieldInfo | None:
    """The field a dotted path names; None inside a free-form dict (optimizer.params.*).
    Raises ConfigError with a did-you-mean for names that do not exist."""
    cls, field = root, None
    for i, part in enumerate(parts):
        if typing.get_origin(cls) is dict:
            return None
        path = ".".join(parts[: i + 1])
        if not is_model(cls):
            raise ConfigError(f"config key '{'.'.join(parts[:i])}' is a value, not a section; "
                              f"set '{'.'.join(parts[:i])}' itself instead of '{'.'.join(parts)}'")
        if part not in cls.model_fields:
            raise ConfigError(unknown_key(path, part, list(cls.model_fields)))
        field = cls.model_fields[part]
        cls = unwrap(field.annotation)
    return field


def _field_at(root: type, loc: tuple) -> tuple[type | None, FieldInfo | None]:
    """(model class holding loc[-1], its field); (None, None) once loc leaves the typed tree."""
    cls: Any = root
    for part in loc[:-1]:
        field = cls.model_fields.get(part) if is_model(cls) and isinstance(part, str) else None
        if field is None:
            return None, None
        cls = unwrap(field.annotation)
    if not is_model(cls) or not loc:
        return (cls if is_model(cls) else None), None
    return cls, cls.model_fields.get(loc[-1])


def field_bounds(field: FieldInfo | None) -> str:
    words = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}
    parts = [f"{op} {getattr(m, k)}" for m in (field.metadata if field else [])
             for k, op in words.items() if getattr(m, k, None) is not None]
    return " and ".join(parts)


def _lines(err: dict, root: type) -> list[str]:
    loc, kind, v = tuple(err["loc"]), err["type"], err.get("input")
    key, ctx = dotted(loc) or "config", err.get("ctx") or {}
    cls, field = _field_at(root, loc)
    dflt = ""
    if field is not None and not field.is_required():
        dflt = f" (default {show(field.get_default(call_default_factory=True))})"
        if is_model(unwrap(field.annotation)):
            dflt = ""  # a whole section's default is not a useful hint
    if kind == "value_error" and isinstance(ctx.get("error"), Rule):   # (an unknown key's line names it already)
        return [m if m.startswith("unknown config key") else f"{'.'.join(p for p in (dotted(loc), k) if p)}: {m}"
                for k, m in ctx["error"].problems]
    if v == "auto" and kind.endswith(("_type", "_parsing", "literal_error")):   # the HF Trainer's placeholder
        return [f"{key}: 'auto' is the Hugging Face Trainer's placeholder, filled in from its TrainingArguments; "
                f"bunsan has no Trainer to fill it: set a value{dflt}"]
    if kind == "extra_forbidden":
        return [unknown_key(key, str(loc[-1]), list(cls.model_fields) if cls else [])]
    if kind == "missing":
        return [f"{key}: required key is missing; add it"]
    if kind in ("bool_type", "bool_parsing"):
        return [f"{key}: expected true/false, got {show(v)}; set it to true or false{dflt}"]
    if kind in ("int_type", "int_parsing", "int_from_float"):
        return [f"{key}: expected a whole number, got {show(v)}; set it to an integer{dflt}"]
    if kind in ("float_type", "float_parsing"):
        return [f"{key}: expected a number, got {show(v)}; set it to a number{dflt}"]
    if kind == "finite_number":
        return [f"{key}: must be a finite number, got {show(v)}; set it to a finite number{dflt}"]
    if kind == "string_type":
        return [f"{key}: expected a string, got {show(v)}; write it in quotes{dflt}"]
    if kind == "list_type":
        return [f"{key}: expected a list, got {show(v)}; write it as a list, e.g. [...]{dflt}"]
    if kind in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
        rule = field_bounds(field) or err["msg"].replace("Input should be ", "")
        return [f"{key}: must be {rule}, got {show(v)}; set it to a value {rule}{dflt}"]
    if kind == "literal_error":
        choices = [str(c) for c in typing.get_args(unwrap(field.annotation))] if field else []
        close = suggest(str(v), choices)
        hint = close if close.startswith("did") else "set it to one of those"
        return [f"{key}: must be one of {', '.join(repr(c) for c in choices) or ctx.get('expected')}, "
                f"got {show(v)}; {hint}{dflt}"]
    if kind in ("dict_type", "model_type", "model_attributes_type"):
        sub = unwrap(field.annotation) if field else None
        valid = f" with keys from: {', '.join(sub.model_fields)}" if is_model(sub) else ""
        return [f"{key}: expected a section (a mapping of keys to values), got {show(v)}; "
                f"write it as a mapping{valid}"]
    return [f"{key}: {err['msg']}, got {show(v)}; fix this value{dflt}"]


def convert(exc: pydantic.ValidationError, root: type, where: str = "") -> ConfigError:
    lines = [line for err in exc.errors() for line in _lines(err, root)]
    return problems_error(lines, where)


def problems_error(lines: list[str], where: str = "") -> ConfigError:
    head = f"{where}: " if where else ""
    if len(lines) == 1:
        return ConfigError(head + lines[0])
    return ConfigError(f"{head}{len(lines)} problems in the config:\n" + "\n".join("  " + s for s in lines))
