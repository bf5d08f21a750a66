"""`bunsan plan` and `bunsan estimate` as a user runs them: the text each prints and its --json, on searches
kept small (one ZeRO stage, one recompute mode) so that each runs in seconds."""

import json

from bunsan.cli.main import main

GiB = 1024 ** 3
SMALL = ["--model", "1b", "--gpus", "8", "--seq-len", "2048", "--global-batch", "16", "--zero-stages", "1",
         "--recompute", "none"]


def test_plan_explain_in_text_mode_prints_the_comparison_and_what_decided_it(capsys):
    assert main(["plan", *SMALL, "--top", "2", "--explain", "tp=2,zero=1"]) == 0
    out = capsys.readouterr().out
    assert "--explain: dp4 tp2" in out and "against the first choice" in out
    peak = [line for line in out.splitlines() if "peak GiB" in line][-1]      # the comparison's row
    assert "fits to 71.5" in peak             # 80 GiB / 1.119, the memory rule's cut (margin.py)
    assert "decided by +" in out and "most from tp_comm" in out
