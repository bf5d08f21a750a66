"""The `bunsan` command: run | train | generate | estimate | plan | convert | serve | doctor | config.

One module per command (train.py, generate.py, plan.py, convert.py, serve.py,
doctor.py, config.py), each with add_parser(s) and cmd_*; process start-up is launch.py's, `bunsan run`
run.py's.
"""

from __future__ import annotations

import argparse
import sys

from bunsan.cli import config, convert, doctor, generate, plan, serve, train
from bunsan.cli.launch import worker_argv
from bunsan.cli.run import run_script


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bunsan", description="Distributed training and inference of LLMs.")
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="launch a script on N processes / M nodes (torchrun)", add_help=False)
    r.add_argument("-h", "--help", action="store_true")
    train.add_parser(sub)
    generate.add_parser(sub)
    plan.add_parsers(sub)
    serve.add_parser(sub)
    doctor.add_parser(sub)
    convert.add_parser(sub)
    config.add_parser(sub)
    return p


COMMANDS = {"train": train.cmd_train, "generate": generate.cmd_generate, "estimate": plan.cmd_estimate,
            "plan": plan.cmd_plan, "convert": convert.cmd_convert, "doctor": doctor.cmd_doctor,
            "serve": serve.cmd_serve, "config": config.cmd_config}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    argv = worker_argv(argv)   # a worker started by `bunsan train --nproc N` (launch.relaunch)
    parser = build_parser()
    if argv and argv[0] == "run":  # everything after `run` belongs to torchrun
        if len(argv) == 1 or argv[1] in ("-h", "--help"):
            from torch.distributed.run import get_args_parser
            get_args_parser().print_help()
            return 0
        return run_script(argv[1:])
    args = parser.parse_args(argv)
    args.argv = argv
    from bunsan.cli.errors import USER_ERRORS, report
    from bunsan.comm.process_group import note_failure
    try:
        rc = COMMANDS[args.cmd](args)
    except USER_ERRORS as e:
        rc = report(args.cmd, e)
    if rc:
        note_failure()      # a failing rank leaves at once: its peers may never reach the exit barrier
    return rc


if __name__ == "__main__":
    sys.exit(main())
