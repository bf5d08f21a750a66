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
    assert "decided by +" in out and "most from " in out and "s per step)" in out


def _plan(capsys, *argv) -> tuple[int, str]:
    rc = main(["plan", *argv])
    return rc, " ".join(capsys.readouterr().out.split())         # (rich wraps long lines)


def test_an_empty_search_names_the_cp_sizes_that_emptied_it_not_memory(capsys):
    """cp 16 on 8 GPUs: no layout to price, the rule and the sizes that would do, and no LoRA advice."""
    rc, out = _plan(capsys, "--model", "1b", "--gpus", "8", "--cp-sizes", "16", "--seq-len", "4096")
    assert rc == 1 and "0 layouts priced" in out and "nothing to price." in out
    assert "4 (tp, cp) pairs ruled out: cp must divide the GPUs left after tensor parallelism (e.g. cp 16 does " \
           "not divide the 8 GPUs left after tp 1)" in out
    assert "--cp-sizes 16: a size must divide the 8 GPUs left after tensor parallelism; pass sizes among " \
           "1,2,4,8" in out
    assert "LoRA" not in out and "leanest layout" not in out


def test_an_empty_search_names_the_global_batch_that_no_data_parallel_size_divides(capsys):
    """The tiny model (4 layers, 2 key/value heads) on 16 GPUs without context parallelism leaves dp 2 at the
    least (tp 2 x pp 4): a global batch of 3 divides no mesh."""
    argv = ["--model", "tiny", "--gpus", "16", "--nodes", "2", "--cp-sizes", "1", "--global-batch", "3"]
    rc, out = _plan(capsys, *argv)
    assert rc == 1 and "nothing to price." in out
    assert "6 meshes ruled out: the global batch must be a multiple of the data-parallel size" in out
    assert "--global-batch 3 is not a multiple of the data-parallel sizes the mesh leaves (2, 4, 8, 16); use a " \
           "multiple of 2, e.g. 4" in out
    assert "LoRA" not in out
    assert main(["plan", *argv, "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["considered"] == 0 and data["rejected"]["batch_dp"]["count"] == 6
    assert data["rejected"]["pp_layers"]["count"] == 3          # pp 8 and 16 over 4 layers
    assert data["emptied_by"][0].startswith("no layout to price") and "e.g. 4" in data["suggestions"][0]
    # the same batch over 16 data-parallel ranks the user can have: fits
    assert main(["plan", *argv[:-1], "16", "--top", "1", "--zero-stages", "0", "--recompute", "none"]) == 0


def test_a_search_emptied_by_memory_says_so_and_what_would_fit(capsys):
    """7B under ZeRO-0 on one 24 GiB A10: every layout priced is past memory; the narrowed options, then the
    memory advice (NVMe offload, more GPUs, LoRA)."""
    rc, out = _plan(capsys, "--model", "7b", "--gpus", "1", "--gpu", "a10", "--zero-stages", "0", "--recompute",
                    "full", "--seq-len", "2048")
    assert rc == 1 and "nothing fits." in out
    assert "memory: every one of the 8 layouts priced was dropped" in out
    assert "8 layouts ruled out: the peak must be within GPU memory" in out and "25.7 GiB the search ranks" in out
    assert "the search was narrowed (--zero-stages 0; --recompute full)" in out
    assert "offload optimizer states and parameters to NVMe" in out and "LoRA fine-tuning" in out


def test_estimate_and_plan_give_one_verdict_on_a_layout_within_the_estimates_error(capsys):
    """A peak 5% under the GPU's memory: a margin-0 cut called it fitting; `plan` ranks it at risk (the measured
    peak reached 1.119x the estimate). `estimate` now says what `plan` says, in its text and its --json."""
    layout = ["--model", "1b", "--gpus", "8", "--zero", "1", "--bf16", "--seq-len", "2048", "--micro-batch", "2",
              "--grad-accum", "1"]
    assert main(["estimate", *layout, "--json"]) == 0
    peak = json.loads(capsys.readouterr().out)["peak_bytes"]
    memory = str(int(peak * 1.05))
    assert main(["estimate", *layout, "--gpu-memory", memory]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "may NOT fit, headroom +" in out and "fits to " in out
    assert "at risk: +7% past memory if the estimate is as low as measured (x1.119)" in out
    assert main(["estimate", *layout, "--gpu-memory", memory, "--json"]) == 0
    est = json.loads(capsys.readouterr().out)
    assert est["peak_bytes"] <= int(memory) and est["fits"] is False and est["verdict"] == "at risk"
    assert main(["plan", "--model", "1b", "--gpus", "8", "--seq-len", "2048", "--global-batch", "16",
                 "--zero-stages", "1", "--recompute", "none", "--gpu-memory", memory, "--explain", "zero=1,mb=2",
                 "--json"]) == 0
    asked = json.loads(capsys.readouterr().out)["explain"]
    assert asked["peak_bytes"]["asked"] == peak and asked["asked_risk"] == est["risk"]
    # past memory even at the lowest measured ratio: dropped by plan, "does NOT fit" here
    assert main(["estimate", *layout, "--gpu-memory", str(int(peak * 0.9))]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "does NOT fit" in out and "`bunsan plan` drops it" in out
    # --margin: the flat cut, as plan's --margin
    assert main(["estimate", *layout, "--gpu-memory", memory, "--margin", "0", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["verdict"] == "fits"


def test_no_activation_offload_leaves_out_the_layouts_that_send_activations_to_the_host(capsys):
    """At 3 GB a GPU, the 1B model at 8K tokens fits mostly by sending blocks' activations to host memory;
    --no-activation-offload (software without it: torchtitan's FSDP2) ranks only what fits without, and an
    empty search names the flag among the narrowings to drop."""
    tight = ["--model", "1b", "--gpus", "8", "--seq-len", "8192", "--global-batch", "16", "--zero-stages", "3",
             "--recompute", "none", "--top", "300", "--json"]
    assert main(["plan", *tight, "--gpu-memory", "3GB"]) == 0
    every = json.loads(capsys.readouterr().out)["ranked"]
    assert main(["plan", *tight, "--gpu-memory", "3GB", "--no-activation-offload"]) == 0
    without = json.loads(capsys.readouterr().out)["ranked"]
    offloaded = [c for c in every if c["layout"]["offload_blocks"]]
    assert offloaded and without and not any(c["layout"]["offload_blocks"] for c in without)
    assert main(["plan", *tight, "--gpu-memory", "2GB", "--no-activation-offload"]) == 1
    assert "--no-activation-offload): drop those options" in json.loads(capsys.readouterr().out)["suggestions"][0]


def test_a_search_reports_its_progress_on_a_terminal_and_nothing_when_piped(capsys, monkeypatch):
    """A large search takes a minute: plan() reports the layouts priced so far and how many fit, and `bunsan plan`
    shows it as a live line on a terminal's stderr; piped (CI, --json into a file) nothing is added."""
    import io
    import re

    import rich.console

    from bunsan.planner import search
    calls = []
    monkeypatch.setattr(search, "PROGRESS_EVERY", 10)
    result = search.plan("1b", 8, seq_len=2048, global_batch=16, progress=lambda n, fit: calls.append((n, fit)))
    assert calls and calls[0][0] == 10 and [n for n, _ in calls] == list(range(10, result.considered + 1, 10))
    assert all(0 <= fit <= n for n, fit in calls) and calls[-1][1] <= result.fit + result.at_risk
    assert main(["plan", *SMALL, "--json"]) == 0          # pytest's stderr is no terminal: nothing added
    captured = capsys.readouterr()
    assert json.loads(captured.out)["considered"] > 0 and "searching layouts" not in captured.err
    screen = io.StringIO()
    terminal = rich.console.Console

    def on_a_terminal(*args, **kwargs):
        return terminal(file=screen, force_terminal=True) if kwargs.get("stderr") else terminal(*args, **kwargs)
    monkeypatch.setattr(rich.console, "Console", on_a_terminal)
    assert main(["plan", *SMALL, "--top", "1"]) == 0
    assert re.search(r"searching layouts: \d+ priced, \d+ fit so far", screen.getvalue())


def test_the_search_offloads_the_fewest_blocks_that_make_a_layout_fit():
    """A layout that does not fit is tried with blocks' activations sent to host memory: the count the search
    settles on (a first guess on the line between none and every block offloaded, then bisection) is the fewest
    that fits, as counting up from one finds it."""
    from bunsan.estimator.estimate import estimate_layout
    from bunsan.estimator.margin import MemoryRule
    from bunsan.planner.search import plan
    memory = 3 * GiB
    result = plan("1b", 8, memory, seq_len=8192, global_batch=16, keep=0)
    offloaded = [c for c in result.ranked if c.layout.offload_blocks and not c.risk]
    assert len(offloaded) > 10
    rule = MemoryRule.of(None)
    for cand in offloaded[::max(1, len(offloaded) // 12)]:
        lay = cand.layout

        def fits(count: int) -> bool:
            e = estimate_layout("1b", lay.replace(offload_blocks=count), gpu_memory=memory)
            return rule.for_run(False, lay.checkpointing).fits(e.peak, memory)
        assert fits(lay.offload_blocks), lay.describe()
        assert lay.offload_blocks == 1 or not fits(lay.offload_blocks - 1), lay.describe()
