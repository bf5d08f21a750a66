"""`bunsan config`: what a key means (--explain KEY or SECTION), every key (--list, or no arguments), and a
config file resolved and validated, as JSON (FILE)."""

from __future__ import annotations

import json


def add_parser(sub) -> None:
    c = sub.add_parser("config", help="explain config keys, list them, or print a config file resolved")
    c.add_argument("file", nargs="?", help="config file (JSON/YAML/TOML): print it resolved (defaults filled in, "
                   "DeepSpeed spellings renamed) and validated, as JSON")
    c.add_argument("--explain", metavar="KEY", help="a dotted key (zero_optimization.stage), a DeepSpeed spelling "
                   "or a section: its type, default and description")
    c.add_argument("--list", action="store_true", help="every key with its one-line description (the default)")


def cmd_config(args) -> int:
    from bunsan.config.deepspeed_intake import explain_row
    from bunsan.config.deepspeed_keys import canonical
    from bunsan.config.errors import ConfigError
    from bunsan.config.explain import entries, explain, find, line, value_at
    from bunsan.config.root import Config
    cfg = Config.load(args.file) if args.file else None
    if args.explain:
        try:
            entry, inner = find(args.explain)
        except ConfigError:
            lines = explain_row(canonical(args.explain.strip()))   # a DeepSpeed key bunsan has no field for
            if lines is None:
                raise
            print("\n".join(lines))
            return 0
        value = value_at(cfg, entry.key) if cfg is not None and entry.section is None else ...
        print("\n".join(explain(entry, inner, value, args.explain.strip())))
        return 0
    if cfg is not None and not args.list:
        missing = cfg.unimplemented()
        if missing:   # what bunsan.initialize would refuse
            raise ConfigError("\n".join(missing))
        print(json.dumps(cfg.to_dict(), indent=2))
        return 0
    table = entries()
    width = max(len(k) for k in table)
    print("\n".join(line(e, width) for e in table.values()))
    return 0
