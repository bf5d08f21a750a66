"""Reading a config file, bounded: a config is small, so whatever is not (a huge file, a pipe or a device that
would block, a YAML alias that expands to gigabytes, JSON nested a hundred thousand deep, a key given twice)
is refused with a message instead of hanging, filling memory or keeping one of two values silently."""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path

import yaml

from bunsan.config.errors import ConfigError

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

__all__ = ["YamlLoader", "read_config_file", "MAX_BYTES"]

MAX_BYTES = 16 << 20       # a config is a few kB; DeepSpeed's largest are under 100 kB
KINDS = {".json": "JSON", ".yaml": "YAML", ".yml": "YAML", ".toml": "TOML"}


class YamlLoader(yaml.SafeLoader):
    """Safe YAML with two changes: 5e8 and 1e-3 are floats (YAML 1.2; PyYAML reads them as strings), and
    aliases (*name) are refused: one alias-of-aliases line expands to billions of values."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            mark = self.peek_event().start_mark
            raise yaml.composer.ComposerError(None, None, "YAML aliases (*name) are not accepted in a bunsan "
                                              "config; write the value out where it is used", mark)
        return super().compose_node(parent, index)


YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?(?:\d[\d_]*(?:\.\d*)?|\.\d+)[eE][-+]?\d+$"),
    list("-+0123456789."))


def _no_duplicates(pairs: list) -> dict:
    seen = {}
    for k, v in pairs:
        if k in seen:
            raise ConfigError(f"key {k!r} appears twice in one JSON object; DeepSpeed refuses that too (only one "
                              "of the two values would be used): keep one")
        seen[k] = v
    return seen


def _text(p: Path) -> str:
    try:
        st = os.stat(p)
    except FileNotFoundError:
        raise ConfigError(f"config file '{p}' does not exist (working directory {os.getcwd()}); check the path") \
            from None
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"config file '{p}' is not a regular file (a directory, pipe or device); pass the path "
                          "of a .json/.yaml/.toml file")
    if st.st_size > MAX_BYTES:
        raise ConfigError(f"config file '{p}' has {st.st_size:,} bytes, more than a config's {MAX_BYTES:,}; "
                          "check the path")
    raw = p.read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file '{p}' is not UTF-8 (byte 0x{raw[e.start]:02x} at offset {e.start}: "
                          f"{e.reason}); save it as UTF-8 (iconv -f latin1 -t utf-8)") from None


def read_config_file(path: str | os.PathLike) -> dict:
    p = Path(path)
    kind = KINDS.get(p.suffix.lower())
    if kind is None:
        raise ConfigError(f"config file '{p}' has unsupported extension '{p.suffix}'; use .json, .yaml/.yml or .toml")
    text = _text(p)
    try:
        data = (json.loads(text, object_pairs_hook=_no_duplicates) if kind == "JSON" else tomllib.loads(text)
                if kind == "TOML" else yaml.load(text, Loader=YamlLoader))
    except RecursionError:
        raise ConfigError(f"config file '{p}' is nested too deeply to be a config; check the file") from None
    except (OSError, UnicodeDecodeError, ValueError, yaml.YAMLError) as e:  # JSON/TOML errors are ValueErrors
        if isinstance(e, ConfigError):
            raise ConfigError(f"config file '{p}': {e}") from None
        raise ConfigError(f"config file '{p}' could not be read as {kind}: {str(e)[:300]}; fix the syntax "
                          f"(or check the file is {kind})") from None
    if data is None or (not text.strip()):
        raise ConfigError(f"config file '{p}' is empty (or null): nothing in it would be used; leave out the "
                          "path to train with the defaults, or write {} to mean them")
    if not isinstance(data, dict):
        raise ConfigError(f"config file '{p}' must hold a mapping of keys at the top level, got "
                          f"{type(data).__name__}; write it as {{\"train_batch_size\": ..., ...}}")
    return data
