"""`plan --json` and `estimate --json` hold every figure the text shows: each test reads the text the user sees,
row by row and line by line, and finds each in the JSON; a row or line the test does not know fails it, so a
figure added to the text without its JSON key (and a line here) cannot pass."""

import json

import pytest

from bunsan.cli.main import main

GiB = 1024 ** 3
BOX = set("┏┃┡│└━┳╇┴┓┩┘─┼")
PLAN = ["plan", "--model", "1b", "--gpus", "8", "--seq-len", "2048", "--global-batch", "16", "--zero-stages", "1",
        "--recompute", "none", "--tokens", "1e12"]
ESTIMATE = ["estimate", "--model", "1b", "--gpus", "8", "--pp", "2", "--zero", "1", "--bf16", "--seq-len", "2048",
            "--micro-batch", "1", "--grad-accum", "4"]


@pytest.fixture(autouse=True)
def _one_line_rows(monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")       # every table row on one line


def _run(capsys, argv) -> tuple[int, str]:
    rc = main(argv)
    return rc, capsys.readouterr().out


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("│┃").split("│" if "│" in line else "┃")]


def _tables(text: str) -> list[list[list[str]]]:
    """Each table of the text: its header and rows, as cells."""
    tables, rows = [], None
    for line in text.splitlines():
        if line.startswith("┏"):
            rows = []
        elif line.startswith("└"):
            tables.append(rows)
            rows = None
        elif rows is not None and line[:1] in "┃│":
            rows.append(_cells(line))
    return tables


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip() and line.strip()[0] not in BOX]


def test_plan_json_holds_every_ranked_layout_unless_top_caps_it(capsys):
    rc, out = _run(capsys, PLAN + ["--json"])
    data = json.loads(out)
    assert rc == 0 and data["considered"] == data["fit"] + data["at_risk"] + data["too_big"] > 100
    assert len(data["ranked"]) == data["shown"] == data["fit"] + data["at_risk"]      # every one, not --top's 8
    assert json.loads(_run(capsys, PLAN + ["--json", "--top", "0"])[1])["shown"] == data["shown"]
    capped = json.loads(_run(capsys, PLAN + ["--json", "--top", "3"])[1])
    assert [c["describe"] for c in capped["ranked"]] == [c["describe"] for c in data["ranked"][:3]]
    assert capped["fit"] == data["fit"]                # the counts are the search's, not the page's
    pricing = data["pricing"]
    assert pricing["gemm_efficiency"] == 0.8 and pricing["gpu"]["name"] == "h100"
    assert pricing["intra_link"]["name"] == "nvlink" and pricing["gpus_per_node"] == 8
    assert pricing["constants"]["HBM_EFFICIENCY"]["value"] == 0.8 and "STREAM" in \
        pricing["constants"]["HBM_EFFICIENCY"]["source"]
    assert main(PLAN + ["--top", "-1"]) == 2
    assert "--top -1: the number of layouts to show, or 0 for all" in capsys.readouterr().err


# the plan table's columns -> the ranked layout's JSON, as the text writes it
PLAN_COLUMNS = {
    "#": lambda c: str(c["rank"]),
    "layout": lambda c: c["describe"],
    "peak GiB": lambda c: f"{c['peak_bytes'] / GiB:.1f}",
    "host GiB/node": lambda c: f"{c['host_bytes_per_node'] / GiB:.0f}",
    "step s": lambda c: f"{c['step_seconds']['total']:.3g}",
    "tokens/s": lambda c: f"{c['step_seconds']['tokens_per_s']:,.0f}",
    "MFU": lambda c: f"{c['step_seconds']['mfu']:.1%}",
    "days": lambda c: f"{c['days']:,.1f}",
    "why": lambda c: c["why"] + (f"; {c['risk']}" if c["risk"] else ""),
}


def test_plan_text_and_json_agree_row_by_row_and_line_by_line(capsys):
    rc, text = _run(capsys, PLAN + ["--top", "3"])
    data = json.loads(_run(capsys, PLAN + ["--top", "3", "--json"])[1])
    assert rc == 0
    (header, *rows), = _tables(text)
    assert set(header) == set(PLAN_COLUMNS), "a plan column without its JSON (add it to PLAN_COLUMNS and --json)"
    assert len(rows) == len(data["ranked"]) == 3
    for row, cand in zip(rows, data["ranked"]):
        assert row == [PLAN_COLUMNS[col](cand) for col in header]
    lines = _lines(text)
    best = data["ranked"][0]["step_seconds"]
    expected = [
        f"{data['model']}: {data['params'] / 1e9:.3g}B parameters on {data['gpus']} x {data['gpu']} "
        f"({data['gpu_memory_bytes'] / GiB:.0f} GiB;",
        f"{data['considered']} layouts priced: {data['fit']} fit, {data['at_risk']} at risk of running out of memory "
        f"(ranked last), {data['too_big']} too big; {data['shown']} shown",
        f"step {best['total']:.4g} s: {best['tokens_per_s']:,.0f} tokens/s, MFU {best['mfu']:.1%}",
        *[f"  {name:<10} {best[name]:10.4g} s" for name in
          ("compute", "recompute", "tp_comm", "dp_comm", "pp_comm", "bubble", "offload", "optimizer", "cp_comm",
               "ep_comm")],
        f"  (data-parallel traffic {best['dp_comm_total']:.4g} s before overlap)",
        "assumptions:",
        *[f"  - {a}" for a in best["assumptions"]],
    ]
    assert f"1 node(s); seq {data['seq_len']}, global batch {data['global_batch']}" in lines[0]
    assert len(lines) == len(expected), "a plan line without its JSON (add it here and to --json)"
    for line, start in zip(lines, expected):
        assert line.startswith(start), (line, start)


def _gib(x: float) -> str:
    return f"{x / GiB:,.2f}" if x else "-"


def test_estimate_text_and_json_agree_row_by_row_and_line_by_line(capsys):
    """Two pipeline stages (each rank's peak, the one shown) and a memory the peak may not fit (the risk line)."""
    data = json.loads(_run(capsys, ESTIMATE + ["--json"])[1])
    memory = int(data["peak_bytes"] * 1.05)
    rc, text = _run(capsys, ESTIMATE + ["--gpu-memory", str(memory)])
    data = json.loads(_run(capsys, ESTIMATE + ["--gpu-memory", str(memory), "--json"])[1])
    assert rc == 0 and data["layout"]["pp"] == 2 and data["verdict"] == "at risk"
    items, zero = _tables(text)
    assert items[0] == ["item", "per GPU GiB", "host GiB", "disk GiB", "when", "what"]
    assert len(items) - 2 == len(data["items"]), "an estimate row without its JSON item"
    for row, item in zip(items[1:], data["items"]):
        assert row == [item["name"], _gib(item["device"]), _gib(item["host"]), _gib(item["disk"]), item["phase"],
                       item["note"]]
    assert items[-1][:4] == ["peak", _gib(data["peak_bytes"]), _gib(data["host_bytes_per_gpu"]),
                             _gib(data["disk_bytes_per_gpu"])]
    assert len(zero) - 1 == len(data["zero_stages"]["stages"]) == 4
    for row, stage in zip(zero[1:], data["zero_stages"]["stages"]):
        ours = stage["this_layout_bytes"]
        assert row == [str(stage["stage"]), f"{stage['zero_paper_bytes'] / 1e9:,.1f}",
                       f"{ours / 1e9:,.1f}" if ours else "-"]
    z = data["zero_stages"]
    expected = [
        f"{data['model']}: {data['params'] / 1e9:.3g}B parameters, {data['describe']}, seq {data['seq_len']}, "
        f"{data['gpus']} GPU(s) on {data['nodes']} node(s)",
        "pipeline ranks' peaks (GiB): " + ", ".join(f"{p / GiB:.2f}" for p in data["stage_peaks"])
        + f"; the table shows rank {data['rank_shown']}",
        f"per node: host {data['host_bytes_per_node'] / GiB:,.1f} GiB, disk {data['disk_bytes_per_node'] / GiB:,.1f} GiB",
        f"model states per GPU by ZeRO stage (Ψ = {z['psi_params_per_model_parallel_rank'] / 1e9:.3g}B per "
        f"model-parallel rank, N = {z['shard_ranks']}, K = {z['k_bytes_per_param']:g})",
        f"GPU memory {data['gpu_memory'] / GiB:.1f} GiB: may NOT fit, headroom {data['headroom_bytes'] / GiB:+.2f} "
        f"GiB; fits to {data['usable_bytes'] / GiB:.2f} GiB",
        f"  {data['risk']}",
    ]
    lines = _lines(text)
    assert len(lines) == len(expected), "an estimate line without its JSON (add it here and to --json)"
    for line, start in zip(lines, expected):
        assert line.startswith(start), (line, start)
