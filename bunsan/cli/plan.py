"""`bunsan estimate` and `bunsan plan`: memory per GPU for one layout, and the layouts that fit, ranked."""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

from bunsan.cli.plan_args import ESTIMATE_FLAGS, ESTIMATE_SWITCHES, GPUS_PER_NODE, MOST_GPUS_PER_NODE
from bunsan.cli.plan_args import add_parsers  # noqa: F401 (main.py's entry to both commands' flags)

GiB = 1024 ** 3


def nodes_for(gpus: int | None, nodes: int | None) -> int:
    """--nodes, checked against --gpus; unset, the nodes that hold `gpus` at 8 per node (said on stderr)."""
    if gpus is None:
        return nodes or 1
    if nodes is None:
        if gpus <= GPUS_PER_NODE:
            return 1
        if gpus % GPUS_PER_NODE:
            raise ValueError(f"--gpus {gpus} without --nodes: bunsan assumes {GPUS_PER_NODE} GPUs per node, and "
                             f"{gpus} is not a multiple of {GPUS_PER_NODE}; pass --nodes (the GPUs must split "
                             "evenly over them)")
        nodes = gpus // GPUS_PER_NODE
        print(f"bunsan: {gpus} GPUs priced as {nodes} nodes of {GPUS_PER_NODE} (pass --nodes to say otherwise)",
              file=sys.stderr)
        return nodes
    if nodes < 1:
        raise ValueError(f"--nodes {nodes}: must be at least 1")
    if gpus % nodes:
        raise ValueError(f"--gpus {gpus} do not split evenly over --nodes {nodes}; use a multiple of {nodes}")
    if gpus // nodes > MOST_GPUS_PER_NODE:
        fits = next(n for n in range(-(-gpus // MOST_GPUS_PER_NODE), gpus + 1) if gpus % n == 0)
        even = f"--nodes {gpus // GPUS_PER_NODE} for {GPUS_PER_NODE} per node" if gpus % GPUS_PER_NODE == 0 else \
            f"at least --nodes {fits} ({gpus // fits} per node)"
        raise ValueError(f"--gpus {gpus} on --nodes {nodes} is {gpus // nodes} GPUs per node; no server holds "
                         f"more than {MOST_GPUS_PER_NODE}: pass {even}")
    return nodes


def _bytes(text: str | None) -> float | None:
    from bunsan.estimator.hardware import parse_bytes
    return None if text is None else float(parse_bytes(text))


def _console():
    from rich.console import Console
    console = Console()
    if not console.is_terminal:       # piped or in CI: wide enough that the tables stay one line a row
        console = Console(width=max(console.width, 160))
    return console


def _gib(x: float) -> str:
    return f"{x / GiB:,.2f}" if x else "-"


def cmd_estimate(args) -> int:
    from rich.table import Table

    from bunsan.config.root import Config
    from bunsan.estimator import estimate
    from bunsan.estimator.hardware import gpu_spec
    from bunsan.estimator.margin import COMPILED_RECOMPUTE_RATIO, MemoryRule

    rule = MemoryRule.of(args.margin)       # the rule `bunsan plan` ranks with: one verdict for a layout
    cfg = Config.load(args.config)
    updates = {key: v for name, (key, _) in ESTIMATE_FLAGS.items() if (v := getattr(args, name)) is not None}
    updates.update({key: True for flag, key in ESTIMATE_SWITCHES.items() if getattr(args, flag)})
    if updates:
        cfg = cfg.override(updates)
    memory = _bytes(args.gpu_memory)
    if memory is None and args.gpu:
        memory = float(gpu_spec(args.gpu).memory_bytes)
    est = estimate(args.model, cfg, gpus=args.gpus, nodes=nodes_for(args.gpus, args.nodes), gpu_memory=memory,
                   device_type=args.device, padding_mask=args.padding_mask)
    rule = rule.for_run(cfg.train.compile and est.device_type == "cuda", est.layout.checkpointing)
    if args.json:
        from bunsan.cli.plan_json import estimate_json
        print(json.dumps(estimate_json(est, memory, rule), indent=2))
        return 0
    console = _console()
    lay = est.layout
    title = (f"{est.model}: {est.n_params / 1e9:.3g}B parameters, {lay.describe()}, seq {lay.seq_len}, "
             f"{lay.gpus} GPU(s) on {est.nodes} node(s)")
    console.print(title, highlight=False)     # (its own line: rich wraps a table's title to the table's width)
    table = Table()
    for col in ("item", "per GPU GiB", "host GiB", "disk GiB", "when", "what"):
        table.add_column(col, justify="right" if "GiB" in col else "left")
    for i in est.items:
        table.add_row(i.name, _gib(i.device), _gib(i.host), _gib(i.disk), i.phase, i.note)
    table.add_row("peak", _gib(est.peak), _gib(sum(i.host for i in est.items)), _gib(sum(i.disk for i in est.items)),
                  "", "always + the larger of backward and step", style="bold")
    console.print(table)
    if lay.pp > 1:
        console.print("pipeline ranks' peaks (GiB): " + ", ".join(f"{p / GiB:.2f}" for p in est.stage_peaks)
                      + f"; the table shows rank {est.rank}")
    console.print(f"per node: host {est.host_per_node / GiB:,.1f} GiB, disk {est.disk_per_node / GiB:,.1f} GiB")
    _zero_table(console, est)
    if memory is not None:
        verdict = rule.verdict(est.peak, memory)
        said = {"fits": "fits", "at risk": "may NOT fit", "does not fit": "does NOT fit"}[verdict]
        unpriced = any(i.note.startswith("NOT PRICED") for i in est.items)
        console.print(f"GPU memory {memory / GiB:.1f} GiB: {said}"
                      + (" before activations (not priced: see the table)" if unpriced else "")
                      + f", headroom {est.headroom / GiB:+.2f} GiB; fits to {rule.usable(memory) / GiB:.2f} GiB "
                      f"({rule.usable_line})", highlight=False)
        if rule.high == COMPILED_RECOMPUTE_RATIO and rule.flat is None:
            console.print(f"  train.compile with whole-block recompute peaked at {COMPILED_RECOMPUTE_RATIO:g}x this "
                          "estimate on an H100 (benchmarks/RESULTS.md, GPU self-check): it fits within memory / "
                          f"{COMPILED_RECOMPUTE_RATIO:g}", highlight=False)
        if verdict == "at risk":
            console.print(f"  {rule.risk(est.peak, memory)}; `bunsan plan` ranks it after the layouts that fit",
                          highlight=False)
        elif verdict == "does not fit":
            console.print(f"  {rule.dropped(memory)}; `bunsan plan` drops it", highlight=False)
    return 0


def _zero_table(console, est) -> None:
    """Model states per GPU for every ZeRO stage: the paper's accounting next to bunsan's buffers."""
    from rich.table import Table

    from bunsan.cli.plan_json import zero_stages
    z = zero_stages(est)
    phi = z["frozen_params_per_model_parallel_rank"]
    console.print(f"model states per GPU by ZeRO stage (Ψ = {z['psi_params_per_model_parallel_rank'] / 1e9:.3g}B "
                  f"per model-parallel rank, N = {z['shard_ranks']}, K = {z['k_bytes_per_param']:g}"
                  + (f"; Φ = {phi / 1e9:.3g}B frozen: weights only, no grads or optimizer states" if phi else "")
                  + ")", highlight=False)
    t = Table()
    for col in ("stage", "ZeRO paper GB (16-bit Ψ, grads)", "this layout's precision GB"):
        t.add_column(col, justify="right")
    for row in z["stages"]:
        ours = row["this_layout_bytes"]
        t.add_row(str(row["stage"]), f"{row['zero_paper_bytes'] / 1e9:,.1f}", f"{ours / 1e9:,.1f}" if ours else "-")
    console.print(t)


def _links(args):
    """(intra, inter) links: named, then with any measured --link-bandwidth / --link-latency applied."""
    from bunsan.estimator.hardware import interconnect, intra_link, with_link
    gpu = _gpu(args)
    links = {"intra": interconnect(args.interconnect) if args.interconnect else intra_link(gpu),
             "inter": interconnect(args.inter_node)}
    for flag, key in (("--link-bandwidth", "bandwidth"), ("--link-latency", "latency")):
        for item in getattr(args, flag[2:].replace("-", "_")):
            which, _, value = item.partition("=")
            if which not in links or not value:
                raise ValueError(f"{flag} {item!r}: write intra=VALUE or inter=VALUE, e.g. {flag} inter="
                                 + ("6.25GB/s" if key == "bandwidth" else "1e-5"))
            links[which] = with_link(links[which], **{key: value if key == "bandwidth" else _seconds(flag, value)})
    return links["intra"], links["inter"]


def _seconds(flag: str, text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{flag}: {text!r} is not a number of seconds; write e.g. 1e-5") from None


def _gpu(args):
    from bunsan.estimator.hardware import gpu_spec, parse_gpu_spec
    gpu = parse_gpu_spec(args.gpu_spec) if args.gpu_spec else gpu_spec(args.gpu)
    if getattr(args, "kernels", None):      # (plan only) this board's measured kernels
        from bunsan.planner.kernels import attach, read_kernels
        gpu = attach(gpu, read_kernels(args.kernels))
    return gpu


def _space(args):
    from bunsan.planner.space import Space
    fields = {}
    if args.zero_stages:
        try:
            fields["zero"] = tuple(int(z) for z in args.zero_stages.split(","))
        except ValueError:
            raise ValueError(f"--zero-stages {args.zero_stages!r}: write stages as 0,1,2,3") from None
    if args.recompute:
        fields["recompute"] = tuple(r.strip() for r in args.recompute.split(","))
    if args.no_sp:
        fields["sequence_parallel"] = (False,)
    if args.no_activation_offload:
        fields["activation_offload"] = False
    if args.cp_sizes:
        try:
            fields["cp"] = tuple(int(c) for c in args.cp_sizes.split(","))
        except ValueError:
            raise ValueError(f"--cp-sizes {args.cp_sizes!r}: write sizes as 1,2,4,8,16") from None
    if args.ep_sizes:
        try:
            fields["ep"] = tuple(int(e) for e in args.ep_sizes.split(","))
        except ValueError:
            raise ValueError(f"--ep-sizes {args.ep_sizes!r}: write sizes as 1,2,4,8") from None
    return Space(**fields)


@contextlib.contextmanager
def _searching():
    """A live line on stderr while a search runs (a large one takes a minute): the layouts priced so far and
    how many fit. Only on a terminal: piped output and --json's stdout stay as they were."""
    from rich.console import Console
    err = Console(stderr=True)
    if not err.is_terminal:
        yield None
        return
    with err.status("searching layouts ...") as status:
        yield lambda priced, fit: status.update(f"searching layouts: {priced:,} priced, {fit:,} fit so far")


def cmd_plan(args) -> int:
    from rich.table import Table

    from bunsan.planner.search import plan

    tokens = int(args.tokens) if args.tokens else None
    if args.top is not None and args.top < 0:
        raise ValueError(f"--top {args.top}: the number of layouts to show, or 0 for all of them")
    # (the table shows 8 unless told; --json holds every ranked layout unless --top caps it)
    top = args.top if args.top is not None else 0 if args.json else 8
    intra, inter = _links(args)

    def search(efficiency, intra, inter):
        with _searching() as progress:
            return plan(args.model, args.gpus, _bytes(args.gpu_memory), gpu=_gpu(args),
                        nodes=nodes_for(args.gpus, args.nodes),
                        seq_len=args.seq_len, global_batch=args.global_batch, interconnect_name=intra,
                        inter_node=inter, precision=args.precision, margin=args.margin, total_tokens=tokens,
                        efficiency=efficiency, host_memory=_bytes(args.host_memory), keep=top,
                        attention=args.attention, space=_space(args), compiled=args.compile, progress=progress)
    result = search(args.efficiency, intra, inter)
    calibration = None
    if args.calibrate:
        from bunsan.planner.calibrate import fit, read_runs, scaled_links
        runs = read_runs(args.calibrate)
        calibration = fit(result, runs, args.efficiency)
        result = search(calibration.efficiency, *scaled_links(result, calibration.comm_scale))
    from bunsan.cli.plan_report import (print_calibration, print_comparison, print_not_searched, runs_after,
                                        unmodelled_line)
    comparison = None
    if args.explain:
        from bunsan.planner.explain import explain
        comparison = explain(result, args.explain)
    if args.json:
        from bunsan.cli.plan_json import plan_json
        out = plan_json(result, top)
        if comparison is not None:
            out["explain"] = comparison.to_json()
        if calibration is not None:
            out["calibration"] = calibration.to_json() | {"runs_after_step_s": runs_after(result, runs)}
        print(json.dumps(out, indent=2))
        return 0 if result.ranked else 1
    console = _console()
    best = result.best
    lay0 = best.layout if best else None
    console.print(f"{result.model}: {result.n_params / 1e9:.3g}B parameters on {result.gpus} x {result.gpu.name} "
                  f"({result.gpu_memory / GiB:.0f} GiB; {result.rule.usable_line}), {result.nodes} node(s)"
                  + (f"; seq {lay0.seq_len}, global batch {lay0.global_batch}" if lay0 else ""))
    shown = min(len(result.ranked), top or len(result.ranked))
    console.print(f"{result.considered} layouts priced: {result.fit} fit, {result.at_risk} at risk of running out "
                  f"of memory (ranked last), {result.too_big} too big; {shown} shown")
    print_not_searched(console, result)
    if not result.ranked:
        console.print("[bold red]nothing to price.[/]" if not result.considered else "[bold red]nothing fits.[/]")
        for line in result.emptied_by:
            console.print(f"  {line}", highlight=False)
        console.print("What would:" if result.considered else "What to change:")
        for s in result.suggestions:
            console.print(f"  - {s}", highlight=False)
        return 1
    table = Table()
    cols = ["#", "layout", "peak GiB", "host GiB/node", "step s", "tokens/s", "MFU", "why"]
    if tokens:
        cols.insert(7, "days")
    for col in cols:
        table.add_column(col, justify="left" if col in ("layout", "why") else "right")
    for n, c in enumerate(result.ranked[:top or None], 1):
        timed = c.step is not None       # (where estimator/shape.py ModelShape.timed_as gives a Llama shape)
        row = [str(n), c.layout.describe(), f"{c.peak / GiB:.1f}", f"{c.estimate.host_per_node / GiB:.0f}",
               f"{c.step.total:.3g}" if timed else "-", f"{c.step.tokens_per_s:,.0f}" if timed else "-",
               f"{c.step.mfu:.1%}" if timed else "-", c.why + (f"; {c.risk}" if c.risk else "")]
        if tokens:
            row.insert(7, f"{result.days(c):,.1f}")
        table.add_row(*row)
    console.print(table)
    if best.step is not None:
        console.print(best.step.explain())
    else:
        console.print(unmodelled_line(result), highlight=False)
    if calibration is not None:
        print_calibration(console, calibration, runs_after(result, runs))
    if comparison is not None:
        print_comparison(console, comparison)
    if args.constants:
        from bunsan.planner.constants import table as constants_table
        console.print("constants (bunsan/planner/constants.py, bunsan/estimator/hardware.py):\n"
                      + constants_table(), highlight=False)
    if args.output:
        section = _model_section(args.model)
        cfg = best.layout.to_config(section)
        cfg["train_batch_size"] = best.layout.global_batch
        if args.compile:        # priced compiled: the config runs what was priced
            cfg.setdefault("train", {})["compile"] = True
        Path(args.output).write_text(json.dumps(cfg, indent=2) + "\n")
        if args.attention != "flash":     # bunsan trains with PyTorch's SDPA, whatever kernel was priced
            console.print(f"note: priced with --attention {args.attention}; bunsan trains with PyTorch's "
                          "scaled_dot_product_attention (the flash kernel PyTorch picks), so the run's attention "
                          "may be slower or faster than priced", highlight=False)
        if not section:    # (`bunsan train` would build bunsan's Llama in its place: no launch line to give)
            console.print(f"wrote {args.output}, the layout only: `bunsan train` builds bunsan's Llama, not this "
                          f"{type(result.pricing.shape.module).__name__}; train it with bunsan.initialize(model, "
                          f"\"{args.output}\") under `bunsan run`", highlight=False)
            return 0
        console.print(f"wrote {args.output}; launch it with, on each node:")
        for line in launch_lines(args.output, result.nodes, result.gpus // result.nodes):
            console.print("  " + line, soft_wrap=True, highlight=False)
    return 0


def launch_lines(config: str, nodes: int, per_node: int) -> list[str]:
    """The `bunsan run` (torchrun) line for each node of the job; one node needs no rendezvous."""
    if nodes == 1:
        return [f"bunsan train {config} --nproc {per_node}"]
    return [f"bunsan run --nnodes {nodes} --nproc-per-node {per_node} --node-rank {r} --master-addr NODE0_ADDRESS "
            f"--master-port 29500 --module bunsan.cli train {config}   # node {r}" for r in range(nodes)]


def _model_section(model: str) -> dict:
    """The config's model section: the preset, or a Llama config's shape as overrides; none for any other model
    (a transformers Qwen2, LLaVA, ...), which `bunsan train` cannot build."""
    from bunsan.models.presets import canonical_name, presets
    name = canonical_name(model)
    if name in presets:
        return {"model": {"preset": name}}
    from bunsan.estimator import load_shape
    c = load_shape(model).llama
    if c is None:
        return {}
    fields = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "rope_theta", "tie_word_embeddings",
              "head_dim")
    return {"model": {"preset": "small", **{f: getattr(c, f) for f in fields}}}

