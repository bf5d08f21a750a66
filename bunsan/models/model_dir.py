"""The JSON files bunsan reads from a model directory, each through one guarded reader.

A model directory is a Hugging Face one (config.json, generation_config.json, the tokenizer's and the processor's
files, model.safetensors.index.json), `bunsan train`'s final/ (the same, with bunsan.json: bunsan's record of the
run) or its adapter/ (peft's adapter_config.json). It may come from anyone, so every such file is read alike:

- a regular file: a directory, a pipe, a device or a socket in its place is said, and never opened (reading a
  pipe could block forever); `follow_links=False` refuses a symbolic link too (a training output's own files);
- under a size cap (a larger file is not one of these, and is not read into memory);
- UTF-8 text holding JSON of the type the file is (config.json an object, ...);
- with the fields bunsan reads (`field`): missing, or of another JSON type, names the field.

Each refusal is one line naming the file, the rule and the fix: a ModelFileError, a ValueError, which the CLI
prints as bunsan's message (cli/errors.py).
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any, NamedTuple

__all__ = ["ModelFileError", "Role", "ROLES", "role_of", "what_is", "regular_file", "read_text", "read_json",
           "field", "json_kind"]

MIB = 1 << 20


class ModelFileError(ValueError):
    """A file of a model directory that bunsan refuses; its message names the file, the rule and the fix."""


class Role(NamedTuple):
    """What a file of a model directory holds, how to mend it, and how large it may be."""
    what: str
    fix: str
    limit: int


_SOURCE = "restore it from the model's source (transformers' save_pretrained writes it)"
# config.json is also final/'s (bunsan train writes it as transformers does)
_CONFIG = "restore it from the model's source (transformers' save_pretrained writes it, `bunsan train` its final/)"
_OUTPUT = "copy final/ again whole from where `bunsan train` wrote it, or train again (the output is damaged)"
_PROCESSOR = Role("the model's processor config (how it reads images or audio)", _SOURCE, 16 * MIB)
ROLES = {
    "config.json": Role("the model's Hugging Face config", _CONFIG, 16 * MIB),
    "generation_config.json": Role("the model's generation settings (its end-of-turn ids)",
                                   _SOURCE + ", or remove it (it is optional)", MIB),
    "tokenizer.json": Role("the Hugging Face tokenizer", "restore it from the model's source (the tokenizers "
                           "library's Tokenizer.save writes it)", 512 * MIB),
    "tokenizer_config.json": Role("the tokenizer's settings (its end token, its chat template)", _SOURCE, 64 * MIB),
    "processor_config.json": _PROCESSOR,
    "preprocessor_config.json": _PROCESSOR,
    "video_preprocessor_config.json": _PROCESSOR,
    "model.safetensors.index.json": Role("the index of the weights' shards",
                                         "copy the directory again whole from the model's source (it is damaged)",
                                         64 * MIB),
    "bunsan.json": Role("`bunsan train`'s record of the run (its config, steps, the weights' sha256)", _OUTPUT,
                        16 * MIB),
    "adapter_config.json": Role("peft's LoRA adapter config", "save the adapter again (peft's save_pretrained, or "
                                "`bunsan train` with lora.save adapter)", MIB),
}
_ANY = Role("a JSON file of the model", "restore it from the model's source", 16 * MIB)

_JSON_NAMES = {dict: "object", list: "list", str: "string", int: "integer", float: "number", bool: "boolean",
               type(None): "null"}


def role_of(path) -> Role:
    return ROLES.get(Path(path).name, _ANY)


def json_kind(value_or_type) -> str:
    """JSON's name of a value's type (or of a type, or of a tuple of types: "integer or number")."""
    if isinstance(value_or_type, tuple):
        return " or ".join(json_kind(t) for t in value_or_type)
    t = value_or_type if isinstance(value_or_type, type) else type(value_or_type)
    return next((name for cls, name in _JSON_NAMES.items() if t is cls), t.__name__)


def what_is(mode: int) -> str | None:
    """What a file of this stat mode is, when it is not a regular file (None for one)."""
    for test, name in ((stat.S_ISREG, None), (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a named pipe (FIFO)"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symbolic link")):
        if test(mode):
            return name
    return "not a regular file"


def regular_file(path, role: Role | None = None, follow_links: bool = True) -> int:
    """The size of `path` when it is a regular file; else a ModelFileError saying what is there (nothing, a
    link to nothing, a directory, a pipe, a device; a link when `follow_links` is False). Nothing is opened."""
    path, role = Path(path), role or role_of(path)
    try:
        st = os.stat(path) if follow_links else os.lstat(path)
    except FileNotFoundError:
        there = "is a symbolic link to nothing" if os.path.islink(path) else "does not exist"
        raise ModelFileError(f"{path} {there}: it holds {role.what}; {role.fix}") from None
    except OSError as e:
        raise ModelFileError(f"{path} cannot be read ({e.strerror or type(e).__name__}): it holds {role.what}; "
                             "check its permissions") from None
    kind = what_is(st.st_mode)
    if kind == "a symbolic link":
        raise ModelFileError(f"{path} is a symbolic link: bunsan reads {role.what} only from a regular file inside "
                             "the directory (links are never followed there); copy the file itself in")
    if kind is not None:
        why = "" if kind in ("a directory", "not a regular file") else " (reading it could block forever)"
        raise ModelFileError(f"{path} is {kind}, not a regular file: bunsan reads {role.what} only from a regular "
                             f"file{why}; {role.fix}")
    return st.st_size


def read_text(path, role: Role | None = None, follow_links: bool = True) -> str:
    """The UTF-8 text of `path`, a regular file under its role's size cap (regular_file's refusals, and a
    larger file or one that is not UTF-8, each a ModelFileError)."""
    path, role = Path(path), role or role_of(path)
    size = regular_file(path, role, follow_links)
    if size > role.limit:
        raise ModelFileError(f"{path} is {size:,} bytes; {role.what} is at most {role.limit:,} (a larger file is "
                             f"not one, and is not read into memory): {role.fix}")
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | (0 if follow_links else getattr(os, "O_NOFOLLOW", 0))
    try:
        fd = os.open(path, flags)
    except OSError as e:       # (replaced between the stat and the open: by a link, or removed)
        raise ModelFileError(f"{path} cannot be read ({e.strerror or type(e).__name__}): it holds {role.what}; "
                             f"{role.fix}") from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):      # (swapped for a pipe after the stat)
            raise ModelFileError(f"{path} is not a regular file: bunsan reads {role.what} only from one; {role.fix}")
        data = f.read(role.limit + 1)
    if len(data) > role.limit:
        raise ModelFileError(f"{path} grew past {role.limit:,} bytes while read; {role.what} is at most that: "
                             f"{role.fix}")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ModelFileError(f"{path} is not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start:,}): it holds "
                             f"{role.what} as JSON; {role.fix}") from None


def read_json(path, expect: type | tuple = dict, role: Role | None = None, follow_links: bool = True) -> Any:
    """The JSON value of `path`, of the type `expect` (a config.json is an object): read_text's refusals, and
    text that is not JSON (its line and column said) or JSON of another type, each a ModelFileError."""
    path, role = Path(path), role or role_of(path)
    text = read_text(path, role, follow_links)
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ModelFileError(f"{path} is not JSON ({e.msg} at line {e.lineno} column {e.colno}): it holds "
                             f"{role.what}; {role.fix}") from None
    except RecursionError:
        raise ModelFileError(f"{path} nests JSON too deeply to be {role.what}; {role.fix}") from None
    if not _is(value, expect):
        article = "an" if path.name[:1] in "aeiou" else "a"
        raise ModelFileError(f"{path} holds a JSON {json_kind(value)}; {article} {path.name} is a JSON "
                             f"{json_kind(expect)}: {role.fix}")
    return value


_REQUIRED = object()


def field(data: dict, key: str, path, expect: type | tuple, meaning: str, default: Any = _REQUIRED,
          role: Role | None = None) -> Any:
    """data[key] (read from `path`) when it is of the type `expect`; `default` when it is missing and one is
    given; else a ModelFileError naming the file, the field, what it holds and the fix."""
    path, role = Path(path), role or role_of(path)
    if key not in data or (data[key] is None and default is not _REQUIRED):
        if default is not _REQUIRED:
            return default
        raise ModelFileError(f"{path} has no \"{key}\" (a JSON {json_kind(expect)}: {meaning}); {role.fix}")
    value = data[key]
    if not _is(value, expect):
        raise ModelFileError(f"{path}: \"{key}\" is a JSON {json_kind(value)}, where {path.name} holds a JSON "
                             f"{json_kind(expect)} ({meaning}); {role.fix}")
    return value


def _is(value, expect: type | tuple) -> bool:
    """isinstance as JSON means it: true and false are not integers, an integer is a number."""
    types = expect if isinstance(expect, tuple) else (expect,)
    if isinstance(value, bool):
        return bool in types
    return isinstance(value, types) or (isinstance(value, int) and float in types)
