"""The planner's search and the `bunsan estimate` / `bunsan plan` commands."""

import json

import pytest

from bunsan.cli.main import main
from bunsan.config.root import Config
from bunsan.estimator import estimate_layout
from bunsan.estimator.layout import Layout
from bunsan.models.llama import LlamaConfig
from bunsan.estimator.margin import COMPILED_RECOMPUTE_RATIO, MEASURED_RATIO, MemoryRule
from bunsan.planner.search import layouts, plan
from bunsan.planner.space import Space
from bunsan.estimator import load_shape

GiB = 1024 ** 3


def test_every_ranked_layout_fits_and_is_sorted():
    p = plan("1b", 8, 40 * GiB, gpu="a100", seq_len=2048, global_batch=64, total_tokens=10 ** 9)
    assert p.ranked and p.considered > len(p.ranked)
    times = [c.step.total for c in p.ranked]
    assert times == sorted(times)
    for c in p.ranked:
        assert c.peak * MEASURED_RATIO[1] <= 40 * GiB and not c.risk     # fits at the estimate's measured error
        assert c.layout.gpus == 8 and c.layout.global_batch == 64
        # The planner's number is the estimator's number for that layout.
        assert estimate_layout("1b", c.layout, gpu_memory=40 * GiB).peak == pytest.approx(c.peak)
    assert p.ranked[0].why == "fastest that fits"
    assert all(c.why.startswith(("+", "same estimated time")) for c in p.ranked[1:])
    assert any(c.why.startswith("+") for c in p.ranked[1:])
    assert p.days(p.ranked[0]) > 0


def test_layouts_are_ones_bunsan_runs():
    shape = load_shape("tiny")
    seen = list(layouts(shape, 4, 4, 64, 8, "bf16"))
    assert seen
    for lay in seen:
        cfg = Config.load(lay.to_config({"model": {"preset": "tiny"}}))
        assert not cfg.unimplemented(), lay.describe()
        assert Layout.from_config(cfg, 4) == lay
        assert not (lay.pp > 1 and lay.grad_accum < lay.pp)


def test_nothing_fits_says_what_would():
    p = plan("70b", 1, 24 * GiB, gpu="rtx4090", seq_len=4096, global_batch=8, host_memory=256 * GiB)
    assert not p.ranked
    text = "\n".join(p.suggestions)
    assert "leanest layout" in text and "GPUs (global batch" in text and "LoRA" in text


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="unknown GPU 'h1000'.*did you mean 'h100'"):
        plan("tiny", 2, gpu="h1000")
    with pytest.raises(ValueError, match="gpus must be a positive int"):
        plan("tiny", 0)
    with pytest.raises(ValueError, match="cannot be spread evenly over 2 nodes"):
        plan("tiny", 3, nodes=2)


def test_cli_estimate_prints_the_table(capsys):
    assert main(["estimate", "--model", "7b", "--gpus", "8", "--zero", "3", "--bf16", "--seq-len", "2048",
                 "--micro-batch", "1", "--gpu", "h100"]) == 0
    out = capsys.readouterr().out
    for word in ("optimizer_states", "activations", "ZeRO-3 gathered", "peak", "ZeRO paper", "fits"):
        assert word in out
    assert main(["estimate", "--model", "tiny", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["params"] == load_shape("tiny").n_params and data["peak_bytes"] > 0


def test_cli_estimate_shows_the_zero_paper_example(capsys):
    assert main(["estimate", "--model", "7.5B", "--gpus", "64", "--fp16"]) == 0
    rows = [line.split("│") for line in capsys.readouterr().out.splitlines() if line.count("│") == 4]
    paper = [r[2].strip() for r in rows if r[1].strip() in "0123"]
    assert paper == ["120.0", "31.4", "16.6", "1.9"]


def test_cli_plan_writes_a_config_train_accepts(tmp_path, capsys):
    out = tmp_path / "best.json"
    assert main(["plan", "--model", "llama-1b", "--gpus", "4", "--gpu", "a100", "--seq-len", "1024",
                 "--global-batch", "32", "--tokens", "1e9", "--output", str(out)]) == 0
    text = capsys.readouterr().out
    assert "fastest that fits" in text and "tokens/s" in text and "days" in text
    cfg = Config.load(out)
    assert cfg.model.preset == "1b"
    lay = Layout.from_config(cfg, 4)
    assert lay.global_batch == 32 and lay.seq_len == 1024


def test_cli_plan_json_has_every_ranked_layout_and_its_terms(capsys):
    import json
    assert main(["plan", "--model", "llama-1b", "--gpus", "4", "--gpu", "a100", "--seq-len", "1024",
                 "--global-batch", "32", "--tokens", "1e9", "--top", "5", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["considered"] > 0 and len(out["ranked"]) == 5 and [c["rank"] for c in out["ranked"]] == [1, 2, 3, 4, 5]
    totals = [c["step_seconds"]["total"] for c in out["ranked"]]
    assert totals == sorted(totals)                                   # fastest first
    first = out["ranked"][0]
    terms = ("compute", "recompute", "tp_comm", "dp_comm", "pp_comm", "cp_comm", "bubble", "offload", "optimizer")
    assert first["step_seconds"]["total"] == pytest.approx(sum(first["step_seconds"][t] for t in terms))
    assert first["layout"]["dp"] * first["layout"]["tp"] * first["layout"]["pp"] * first["layout"]["cp"] == 4
    assert first["peak_bytes"] <= out["usable_bytes"] and first["risk"] is None and first["days"] > 0
    assert main(["plan", "--model", "llama-70b", "--gpus", "1", "--gpu", "a10", "--host-memory", "8GB", "--json"]) == 1
    empty = json.loads(capsys.readouterr().out)
    assert empty["ranked"] == [] and empty["suggestions"]


def test_cli_plan_searches_the_cp_sizes_asked_for(capsys):
    import json
    assert main(["plan", "--model", "7b", "--gpus", "32", "--nodes", "4", "--gpu", "h100", "--seq-len", "65536",
                 "--global-batch", "32", "--cp-sizes", "16", "--top", "3", "--json"]) == 0
    ranked = json.loads(capsys.readouterr().out)["ranked"]
    assert ranked and {c["layout"]["cp"] for c in ranked} == {16}        # beyond the default (1, 2, 4, 8)
    assert main(["plan", "--model", "7b", "--gpus", "8", "--cp-sizes", "two"]) == 2
    assert "--cp-sizes 'two': write sizes as 1,2,4,8,16" in capsys.readouterr().err


@pytest.mark.e2e
def test_plan_explain_prices_a_named_layout_as_the_first_choice_and_compares_term_by_term(capsys):
    """The first choice explained against itself differs in nothing; a TP-8 layout across the search's
    first choice loses on tensor-parallel traffic, priced as the search prices it; a layout past the memory
    is said to be dropped for memory; a bad spec is an error naming it."""
    import json
    from bunsan.planner.explain import explain
    from bunsan.planner.search import plan
    result = plan("7b", 16, gpu="h100", nodes=2, seq_len=4096, global_batch=32, keep=3)
    best = result.best.layout
    same = explain(result, f"dp={best.dp},tp={best.tp},pp={best.pp},cp={best.cp},zero={best.zero},"
                           f"mb={best.micro_batch},recompute={best.checkpointing},sp={best.sequence_parallel},"
                           f"schedule={best.schedule},v={best.virtual_stages},pipeline_gather={best.pipeline_gather}")
    assert same.asked.step.total == pytest.approx(same.best.step.total) and same.asked.peak == pytest.approx(
        same.best.peak)
    tp8 = explain(result, "tp=8,pp=2,zero=1,mb=1,recompute=selective,sp=true")
    assert tp8.asked.layout.dp == 1 and tp8.asked.layout.grad_accum == 32
    assert "most from tp_comm" in tp8.decided_by() and tp8.asked.step.total > tp8.best.step.total
    huge = explain(result, "dp=16,zero=0,mb=2")
    assert huge.decided_by().startswith("memory: it peaks at")
    with pytest.raises(ValueError, match=r"--explain 'tp8': expected KEY=VALUE"):
        explain(result, "tp8")
    with pytest.raises(ValueError, match="tp x pp x cp = 3 does not divide the 16 GPUs"):
        explain(result, "tp=3")
    assert main(["plan", "--model", "7b", "--gpus", "16", "--nodes", "2", "--seq-len", "4096", "--global-batch",
                 "32", "--top", "2", "--json", "--explain", "tp=8,pp=2,zero=1"]) == 0
    out = json.loads(capsys.readouterr().out)["explain"]
    assert out["asked"].startswith("dp1 tp8") and "tp_comm" in out["terms_s"] and out["decided_by"]


def test_cli_errors_exit_2(capsys):
    assert main(["plan", "--model", "tinny", "--gpus", "2"]) == 2
    assert "did you mean 'tiny'" in capsys.readouterr().err
    assert main(["estimate", "--model", "tiny", "--gpu-memory", "lots"]) == 2
    assert "lots" in capsys.readouterr().err


def test_a_bare_count_is_priced_as_a_llama_of_that_count(capsys):
    """`--model 68.98B` is a Llama shape of 68.98B parameters (blocks as ZeRO-3 units), not one tensor."""
    shape = load_shape("68.98B")
    assert shape.bare and shape.llama is not None and "priced as a Llama" in shape.name
    assert abs(shape.n_params - 68.98e9) < 2 * shape.llama.hidden_size   # the vocabulary absorbs the rest
    assert main(["estimate", "--model", "68.98B", "--gpus", "64", "--zero", "3", "--gpu", "h100"]) == 0
    out = capsys.readouterr().out
    assert "priced as a Llama" in out and ": fits, headroom +" in out


def test_cli_plan_output_gives_a_launch_line_per_node(tmp_path, capsys):
    out = tmp_path / "best.json"
    assert main(["plan", "--model", "tiny", "--gpus", "4", "--nodes", "2", "--gpu", "a100", "--seq-len", "128",
                 "--global-batch", "8", "--link-bandwidth", "inter=6.25GB/s", "--output", str(out), "--constants"]) == 0
    text = capsys.readouterr().out
    assert "GEMM_EFFICIENCY" in text and "tuning.cc" in text
    for rank in (0, 1):
        assert f"bunsan run --nnodes 2 --nproc-per-node 2 --node-rank {rank}" in text
    assert "6.25e+09" in text                  # the measured link is the one priced


@pytest.mark.parametrize("argv, words", [
    (["--link-bandwidth", "fabric=6GB/s"], ["intra=VALUE or inter=VALUE"]),
    (["--link-bandwidth", "inter=fast"], ["'fast'", "bandwidth"]),
    (["--gpu-spec", "a100,tflops=3"], ["'tflops'", "bf16, fp16, fp32, memory, hbm"]),
    (["--zero-stages", "4"], ["Space.zero", "(0, 1, 2, 3)"]),
])
def test_cli_plan_overrides_name_bad_values(argv, words, capsys):
    assert main(["plan", "--model", "tiny", "--gpus", "2"] + argv) == 2
    err = capsys.readouterr().err
    for word in words:
        assert word in err


def test_the_search_walks_context_parallel_and_uneven_interleaved_chunks():
    """Every layout bunsan runs: cp sizes that split the row into 2 x cp chunks, and interleaved schedules
    whose chunks are uneven (6 layers over pp 2 x v 2: 2, 2, 1, 1 blocks), each accepted by the config."""
    six = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                      num_attention_heads=4, max_position_embeddings=256)
    seen = list(layouts(load_shape(six), 8, 8, 256, 16, "bf16"))
    cps = {lay.cp for lay in seen}
    assert cps == {1, 2, 4, 8}
    assert all(lay.seq_len % (2 * lay.cp) == 0 for lay in seen if lay.cp > 1)
    assert all(lay.gpus == 8 for lay in seen)
    uneven = [lay for lay in seen if lay.schedule == "interleaved" and 6 % (lay.pp * lay.virtual_stages)]
    assert uneven, "interleaved layouts with uneven chunks are missing"
    cfg = Config.load(uneven[0].to_config({"model": {"preset": "tiny", "num_hidden_layers": 6}}))
    assert not cfg.unimplemented() and Layout.from_config(cfg, 8) == uneven[0]
    # a row too short to split 2 x cp ways is not tried
    assert {lay.cp for lay in layouts(load_shape(six), 8, 8, 4, 16, "bf16")} == {1, 2}


def test_a_long_sequence_plans_context_parallelism_first():
    """128k tokens per row of a 1B model on 8 H100s: splitting the row over 8 ranks beats tensor parallelism
    (whose activations and all-reduces grow with the row), and the plan says so."""
    p = plan("1b", 8, gpu="h100", seq_len=131072, global_batch=8)
    assert p.best.layout.cp > 1, p.best.layout.describe()
    without = plan("1b", 8, gpu="h100", seq_len=131072, global_batch=8, space=Space(cp=(1,)))
    assert all(c.layout.cp == 1 for c in without.ranked)
    assert p.best.step.total < without.best.step.total


def test_gpus_without_nodes_are_priced_at_8_per_node_and_an_impossible_node_is_refused(capsys):
    assert main(["estimate", "--model", "7b", "--gpus", "8192", "--zero", "3", "--json"]) == 0
    captured = capsys.readouterr()
    assert "8192 GPUs priced as 1024 nodes of 8" in captured.err
    one_node = json.loads(captured.out)["host_bytes_per_node"]
    assert main(["estimate", "--model", "7b", "--gpus", "8", "--zero", "3", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["host_bytes_per_node"] == one_node   # a node of 8 either way
    assert main(["estimate", "--model", "7b", "--gpus", "8192", "--nodes", "1"]) == 2
    assert "8192 GPUs per node; no server holds more than 16: pass --nodes 1024" in capsys.readouterr().err
    assert main(["plan", "--model", "tiny", "--gpus", "12"]) == 2
    assert "12 is not a multiple of 8; pass --nodes" in capsys.readouterr().err


@pytest.mark.e2e
def test_plan_calibrate_recovers_the_constants_of_measured_runs(tmp_path, capsys):
    """Four runs priced with a GEMM efficiency of 0.6 and links at half their bandwidth, given as measured:
    the fit finds both, every run's error falls from over 15% to under 1%, and the plan is searched with them."""
    import dataclasses
    import json
    from bunsan.planner.explain import parse_layout
    from bunsan.planner.search import plan
    kw = dict(gpu="h100", nodes=2, seq_len=4096, global_batch=32, keep=3, precision="bf16")   # (bf16: a third)
    base = plan("7b", 16, **kw)
    half = [dataclasses.replace(link, bytes_per_s=link.bytes_per_s / 2) for link in (base.pricing.intra,
                                                                                      base.pricing.inter)]
    truth = plan("7b", 16, **kw, efficiency=0.6, interconnect_name=half[0], inter_node=half[1])
    layouts = ["tp=8,pp=2,zero=1,mb=1,recompute=selective,sp=true", "tp=4,zero=1,mb=1,recompute=full",
               "dp=16,zero=3,mb=2,recompute=full", "tp=2,pp=2,zero=1,mb=1,recompute=selective"]
    runs = [{"layout": t, "step_s": truth.pricing.price(parse_layout(t, truth)).step.total} for t in layouts]
    runs[1] = {"layout": layouts[1], "tokens_per_s": 32 * 4096 / runs[1]["step_s"]}     # either figure
    path = tmp_path / "runs.json"
    path.write_text(json.dumps(runs))
    args = ["plan", "--model", "7b", "--gpus", "16", "--nodes", "2", "--seq-len", "4096", "--global-batch", "32",
            "--top", "2", "--precision", "bf16"]
    assert main(args + ["--calibrate", str(path), "--json"]) == 0
    cal = json.loads(capsys.readouterr().out)["calibration"]
    assert cal["efficiency"] == pytest.approx(0.6, rel=0.03) and cal["comm_scale"] == pytest.approx(2.0, rel=0.05)
    for run, after in zip(cal["runs"], cal["runs_after_step_s"]):
        assert abs(run["priced_step_s_before"] / run["measured_step_s"] - 1) > 0.15
        assert after == pytest.approx(run["measured_step_s"], rel=0.01)
    assert main(args + ["--calibrate", str(path)]) == 0
    assert "--calibrate: compute x" in capsys.readouterr().out
    path.write_text(json.dumps([{"layout": "tp=2"}]))
    assert main(args + ["--calibrate", str(path)]) == 2
    assert "give its layout (a string) and one positive step_s or tokens_per_s" in capsys.readouterr().err


@pytest.mark.e2e
def test_the_memory_cut_follows_the_estimates_measured_error():
    """A layout whose estimated peak fits at the highest measured/estimated ratio is ranked; one that fits at
    the lowest ratio only is ranked after those, with how far past memory it may go; beyond, it is dropped.
    `margin` keeps the flat cut it names."""
    rule = MemoryRule()
    assert rule.fits(0.89 * GiB, GiB) and not rule.risk(0.89 * GiB, GiB)
    assert not rule.fits(0.95 * GiB, GiB) and rule.ranked(0.95 * GiB, GiB)
    assert "at risk: +6% past memory" in rule.risk(0.95 * GiB, GiB)
    assert not rule.ranked(1.08 * GiB, GiB)
    with pytest.raises(ValueError, match="margin 1.5 must be a fraction"):
        MemoryRule.of(1.5)
    args = dict(gpu="a100", seq_len=2048, global_batch=64, keep=0)
    lean = plan("1b", 8, 40 * GiB, **args).ranked[0]
    memory = lean.peak * 1.05            # within the error band: it may or may not fit
    p = plan("1b", 8, memory, **args)
    risky = [c for c in p.ranked if c.risk]
    assert risky and all(c.risk.startswith("at risk:") and "past memory" in c.risk for c in risky)
    tiers = [bool(c.risk) for c in p.ranked]
    assert tiers == sorted(tiers) and any(tiers) and not all(tiers)        # the ones that fit come first
    for c in p.ranked:
        assert (c.peak * MEASURED_RATIO[1] <= memory) != bool(c.risk) and c.peak * MEASURED_RATIO[0] <= memory
    flat = plan("1b", 8, memory, margin=0.10, **args)
    assert all(c.peak <= 0.9 * memory and not c.risk for c in flat.ranked)
    assert not {c.layout for c in risky} & {c.layout for c in flat.ranked}



@pytest.mark.e2e
def test_compiled_whole_block_recompute_is_cut_at_its_own_measured_ratio(tmp_path, capsys):
    """The H100 self-check measured train.compile + whole-block recompute at 1.311x the estimate (eager and
    compiled without recompute within 1%): such a layout fits only within memory / 1.311, in `plan --compile`
    and in `bunsan estimate` of a compiled config; eager, selective and CPU runs keep the common ratios."""
    rule = MemoryRule()
    assert rule.for_run(True, "full").high == COMPILED_RECOMPUTE_RATIO
    assert rule.for_run(False, "full") is rule and rule.for_run(True, "selective") is rule
    assert rule.for_run(True, "none") is rule and MemoryRule.of(0.1).for_run(True, "full").flat == 0.1
    args = dict(gpu="a100", seq_len=2048, global_batch=64, keep=0)
    eager = plan("1b", 8, 40 * GiB, **args)
    full = min((c for c in eager.ranked if c.layout.checkpointing == "full"), key=lambda c: c.peak)
    memory = full.peak * 1.2         # fits at 1.119x the estimate, not at 1.311x
    eager, compiled = plan("1b", 8, memory, **args), plan("1b", 8, memory, compiled=True, **args)
    by_layout = {c.layout: c for c in compiled.ranked}
    assert not next(c for c in eager.ranked if c.layout == full.layout).risk
    assert "at risk" in by_layout[full.layout].risk
    for c in compiled.ranked:       # every other recompute mode keeps the common ratio
        ratio = COMPILED_RECOMPUTE_RATIO if c.layout.checkpointing == "full" else MEASURED_RATIO[1]
        assert (c.peak * ratio <= memory) != bool(c.risk)
    path = tmp_path / "compiled.json"
    for compiled_too in (False, True):
        path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "train": {"compile": compiled_too},
                                    "activation_checkpointing": {"enabled": True}}))
        argv = ["estimate", "--model", "1b", "--config", str(path), "--seq-len", "2048"]
        if not compiled_too:
            capsys.readouterr()
            assert main(argv + ["--json"]) == 0
            peak = json.loads(capsys.readouterr().out)["peak_bytes"]
        assert main(argv + ["--gpu-memory", str(int(peak * 1.2))]) == 0      # the same peak: compile adds none
        out = capsys.readouterr().out
        assert ("peaked at 1.311x this estimate" in out) == compiled_too, out
        assert ("may NOT fit" in out) == compiled_too, out

def test_long_rows_search_context_parallel_past_8_and_short_ones_do_not():
    """Every power of two the mesh allows to 8; past 8 while each rank keeps 8192 of the row's tokens (a
    128k row on 64 GPUs: cp 16, not 32); a Space's own sizes replace the rule."""
    from bunsan.planner.space import cp_sizes
    shape = load_shape("1b")
    assert cp_sizes(shape, 64, 1, 131072, Space()) == [1, 2, 4, 8, 16]
    assert cp_sizes(shape, 64, 2, 262144, Space()) == [1, 2, 4, 8, 16, 32]
    assert cp_sizes(shape, 64, 1, 8192, Space()) == [1, 2, 4, 8]
    assert cp_sizes(shape, 64, 1, 131072, Space(cp=(1, 2))) == [1, 2]
    with pytest.raises(ValueError, match="Space.cp is empty"):
        Space(cp=())


def test_explain_says_a_layout_is_dropped_past_the_threshold_that_drops_it():
    """The search drops a peak past memory / the lowest measured ratio (not past memory / the highest, where a
    layout stops fitting for sure and is ranked at risk): the reason names that threshold and its rule."""
    from types import SimpleNamespace

    from bunsan.planner.explain import Comparison

    def said(peak: float, rule: MemoryRule) -> str:
        return Comparison(None, SimpleNamespace(peak=peak, risk=""), 80 * GiB, rule).decided_by()
    text = said(1.08 * 80 * GiB, MemoryRule())         # x0.935 is still past memory
    assert text.startswith("memory: it peaks at 86.4 GiB per GPU")
    assert f"past the {80 / MEASURED_RATIO[0]:.1f} GiB the search ranks (80.0 GiB / 0.935)" in text
    assert f"{80 / MEASURED_RATIO[1]:.1f}" not in text and text.endswith("so the search drops it")
    flat = said(75 * GiB, MemoryRule.of(0.1))
    assert "past the 72.0 GiB that fit with 10% of 80.0 GiB kept free (--margin)" in flat
