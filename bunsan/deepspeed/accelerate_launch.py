"""`python -m bunsan.deepspeed.accelerate_launch [accelerate launch's arguments] script.py ...`: accelerate's own
`accelerate launch`, in a process where `import deepspeed` is bunsan.deepspeed (alias.py), so that an accelerate
config with `distributed_type: DEEPSPEED` (a DeepSpeed plugin) starts its workers as with DeepSpeed installed.

The launched script calls `bunsan.deepspeed.install()` before it imports transformers or accelerate, as under
torchrun. accelerate reaches DeepSpeed's own multi-node runner (pdsh) only for `num_machines` > 1 with a launcher
other than "standard": that is refused with what to use instead.
"""

from __future__ import annotations

import os
import sys

from bunsan.deepspeed.alias import install


def main(argv: list[str] | None = None) -> None:
    from accelerate.commands.config import default_config_file, load_config_from_file
    from accelerate.commands.launch import launch_command, launch_command_parser
    args = launch_command_parser().parse_args(sys.argv[1:] if argv is None else argv)
    path = args.config_file or (default_config_file if os.path.isfile(default_config_file) else None)
    defaults = load_config_from_file(path) if path else None
    machines = args.num_machines or (defaults.num_machines if defaults else 1)
    launcher = args.deepspeed_multinode_launcher or ((defaults.deepspeed_config or {}).get(
        "deepspeed_multinode_launcher") if defaults else None) or "pdsh"      # accelerate's default
    if machines > 1 and launcher != "standard":
        sys.exit(f"bunsan.deepspeed.accelerate_launch: deepspeed_multinode_launcher {launcher!r} on "
                 f"{machines} machines runs DeepSpeed's own `deepspeed` command, which bunsan does not have; set "
                 "deepspeed_multinode_launcher: standard (torchrun on every node)")
    install()       # accelerate checks for DeepSpeed when it launches, not when it is imported
    launch_command(args)


if __name__ == "__main__":
    main()
