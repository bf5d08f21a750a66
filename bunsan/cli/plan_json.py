"""What `bunsan plan --json` and `bunsan estimate --json` print: every figure their text shows, as data.

The text's tables and lines are built from the same data (`zero_stages` feeds the ZeRO table and the JSON
alike); tests/test_planner_json.py reads the text and checks each table row and line against a JSON key,
so that a row added to the text without its JSON fails there.
"""

from __future__ import annotations

import dataclasses

GiB = 1024 ** 3


# ---------------------------------------------------------------- estimate

def zero_stages(est) -> dict:
    """Model states per GPU for every ZeRO stage: the ZeRO paper's accounting (16-bit parameters and
    gradients, K bytes of optimizer states per parameter) next to bunsan's at this layout's precision (which
    keeps the gradient shard in fp32), with the paper's Ψ, N and K. Frozen parameters (LoRA's base, a frozen
    encoder: Φ of them) are weights only, in both columns as in the estimate: no gradients, master weights or
    optimizer states, sharded at stage 3."""
    from bunsan.estimator import zero_paper
    from bunsan.memory.theory import model_states, optimizer_bytes, with_frozen_base
    lay = est.layout
    k = optimizer_bytes(lay.optimizer, [(1,)]) + (4 if lay.dtype_bytes < 4 else 0)
    # the fullest pipeline rank by elements held, trained and frozen (the ranks the estimate priced)
    frozen = est.frozen or [None] * len(est.trained)
    rp, base = max(zip(est.trained, frozen), key=lambda r: r[0].total + (r[1].total if r[1] else 0))
    phi = base.total if base is not None else 0
    # (Ψ: the paper's even share of the model; with frozen weights, the trained elements of the rank shown)
    psi = est.n_params / (lay.tp * lay.pp) if not phi else rp.total
    rows = []
    for stage in range(4):
        st = with_frozen_base(model_states(rp, lay.shard_ranks, stage, lay.dtype_bytes, lay.optimizer), phi,
                              lay.shard_ranks, stage, lay.dtype_bytes)
        ours = st["model_states"] + st["disk"]
        paper = zero_paper(psi, lay.shard_ranks, k, stage) + 2 * phi / (lay.shard_ranks if stage == 3 else 1)
        rows.append({"stage": stage, "zero_paper_bytes": paper, "this_layout_bytes": ours or None})
    return {"psi_params_per_model_parallel_rank": psi, "frozen_params_per_model_parallel_rank": phi,
            "shard_ranks": lay.shard_ranks, "k_bytes_per_param": k, "stages": rows}


def estimate_json(est, memory: float | None, rule) -> dict:
    """`bunsan estimate`'s tables and lines: the title's model, layout, sequence, GPUs and nodes; every item
    (the table's rows) and the peak row's sums; each pipeline rank's peak and the one the table shows; the
    host and disk per node; the ZeRO table; against `memory`, the verdict of plan's memory `rule`."""
    lay = est.layout
    unpriced = [i.name for i in est.items if i.note.startswith("NOT PRICED")]
    out = {"model": est.model, "params": est.n_params, "layout": dataclasses.asdict(lay),
           "describe": lay.describe(), "seq_len": lay.seq_len, "gpus": lay.gpus, "nodes": est.nodes,
           "device_type": est.device_type, "items": [vars(i) for i in est.items],
           "peak_bytes": est.peak, "host_bytes_per_gpu": sum(i.host for i in est.items),
           "disk_bytes_per_gpu": sum(i.disk for i in est.items),
           "stage_peaks": est.stage_peaks, "rank_shown": est.rank,
           "host_bytes_per_node": est.host_per_node, "disk_bytes_per_node": est.disk_per_node,
           "zero_stages": zero_stages(est), "unpriced_items": unpriced,
           "gpu_memory": memory, "memory_rule": rule.to_json(), "fits": None, "verdict": None, "risk": None,
           "headroom_bytes": None, "usable_bytes": None, "ranked_to_bytes": None}
    if memory is not None:
        out |= {"fits": rule.fits(est.peak, memory), "verdict": rule.verdict(est.peak, memory),
                "risk": rule.risk(est.peak, memory) or None, "headroom_bytes": memory - est.peak,
                "usable_bytes": rule.usable(memory), "ranked_to_bytes": rule.ranked_to(memory)}
    return out


# ---------------------------------------------------------------- plan

def pricing_json(result) -> dict:
    """What every layout was priced with: the GPU's figures, the links, the GEMM efficiency used, attention,
    and every constant of planner/constants.py with its source."""
    from bunsan.estimator import hardware
    from bunsan.planner import constants as K
    p = result.pricing
    gpu = p.gpu
    return {"gpu": {"name": gpu.name, "memory_bytes": gpu.memory_bytes, "peak_flops": dict(gpu.peak_flops),
                    "hbm_bytes_per_s": gpu.hbm_bytes_per_s, "form": gpu.form, "power_w": gpu.power_w,
                    "sms": gpu.sms, "rated_power_w": gpu.rated_power_w, "sustained_fraction": gpu.sustained_fraction,
                    "matmul_fraction": gpu.matmul_fraction,
                    # each attention kernel's published forward + backward fraction of the peak (None: unmeasured)
                    "attention_fractions": {k: gpu.attention_fraction(k) for k in ("flash", "cudnn", "triton")}},
            "measured_kernels": None if gpu.measured is None else {
                "source": gpu.measured.source, "device": gpu.measured.device,
                "reference_tflops": gpu.measured.reference_tflops, "flash_tflops": gpu.measured.flash_tflops,
                "gemm_shapes": [list(kn) for kn in gpu.measured.gemm], "flash_curve": gpu.measured.flash},
            "gpus_per_node": p.per_node, "intra_link": dataclasses.asdict(p.intra),
            "inter_link": dataclasses.asdict(p.inter), "attention": p.attention, "compiled": p.compiled,
            "gemm_efficiency": K.GEMM_EFFICIENCY if p.efficiency is None else p.efficiency,
            "host": {"host_link_bytes_per_s": hardware.HOST_LINK_BYTES_PER_S,
                     "nvme_read_bytes_per_s": hardware.NVME_READ_BYTES_PER_S,
                     "nvme_write_bytes_per_s": hardware.NVME_WRITE_BYTES_PER_S,
                     "cpu_adam_params_per_s": hardware.CPU_ADAM_PARAMS_PER_S},
            "constants": {name: {"value": value, "source": source} for name, value, source in K.SOURCES}}


def candidate_json(result, rank: int, c) -> dict:
    """One ranked layout: the table's columns (layout, peak, host per node, step, tokens/s, MFU, days, why and
    risk), its fields, and where the step time is modelled every priced term in seconds."""
    step = None
    if c.step is not None:
        step = {k: v for k, v in dataclasses.asdict(c.step).items() if k != "assumptions"}
        step |= {"total": c.step.total, "tokens_per_s": c.step.tokens_per_s, "mfu": c.step.mfu,
                 "assumptions": list(c.step.assumptions)}
    return {"rank": rank, "layout": dataclasses.asdict(c.layout), "describe": c.layout.describe(),
            "peak_bytes": c.peak, "host_bytes_per_node": c.estimate.host_per_node, "step_seconds": step,
            "days": result.days(c) if result.total_tokens and c.step is not None else None, "why": c.why,
            "risk": c.risk or None}


def plan_json(result, top: int) -> dict:
    """The search as data: its inputs, how many layouts were priced, fit, were at risk and too big, what each
    rule left out, the dimensions not searched for this model and why, every ranked layout (`top` of them; 0:
    all), the suggestions when none is ranked, and the pricing constants."""
    lay0 = result.best.layout if result.best else None
    shown = result.ranked[:top or None]
    return {"model": result.model, "params": result.n_params, "gpus": result.gpus, "nodes": result.nodes,
            "gpu": result.gpu.name, "gpu_memory_bytes": result.gpu_memory,
            "seq_len": lay0.seq_len if lay0 else None, "global_batch": lay0.global_batch if lay0 else None,
            "usable_bytes": result.rule.usable(result.gpu_memory),
            "ranked_to_bytes": result.rule.ranked_to(result.gpu_memory), "memory_rule": result.rule.to_json(),
            "considered": result.considered, "fit": result.fit, "at_risk": result.at_risk,
            "too_big": result.too_big, "shown": len(shown), "rejected": result.rejected.to_json(),
            "emptied_by": list(result.emptied_by),
            "not_searched": dict(result.not_searched),
            "ranked": [candidate_json(result, n, c) for n, c in enumerate(shown, 1)],
            "suggestions": list(result.suggestions),
            "pricing": pricing_json(result) if result.pricing is not None else None}
