"""The assumptions a priced step lists beside its terms (cost.step_time): the figures and rules each term
was priced from, in words."""

from __future__ import annotations

from bunsan.estimator.hardware import (CPU_ADAM_PARAMS_PER_S, HOST_LINK_BYTES_PER_S, NVME_READ_BYTES_PER_S,
                                       NVME_WRITE_BYTES_PER_S)
from bunsan.planner import constants as K


def step_notes(model, layout, gpu, topo, eff, attention, n_flops, flops_per_token, compiled,
               overlap: tuple = ()) -> tuple:
    """The assumptions a StepTime lists (`plan --explain`, --json): what each term was priced from; `overlap`
    (cost.OVERLAPS) the traffic another framework hides, which the tp and dp lines then say."""
    link = {name: topo.link(size, stride).name for name, size, stride in
            (("tp", layout.tp, 1), ("cp", layout.cp, layout.tp), ("dp", layout.shard_ranks, layout.tp),
             ("pp", layout.pp, layout.tp * layout.shard_ranks))}
    return (
        f"{flops_per_token / 1e9:.4g} GFLOP/token = 6N (N={n_flops:,}, no input embedding) + 12·L·h·s "
        + (f"(h the {model.attention_dim} query heads' width) " if not model.head_dim_derived else "") + "counts "
        f"MFU; time is priced per GEMM: roofline of {eff:.0%} of {gpu.sustained_flops(layout.precision) / 1e12:.4g} "
        f"TFLOP/s {layout.precision} and {K.HBM_EFFICIENCY:.0%} of {gpu.hbm_bytes_per_s / 1e12:.3g} TB/s HBM on "
        f"{gpu.name}" + (f" ({gpu.form}, {gpu.power_w:g} W)" if gpu.form and gpu.power_w else "")
        + (f" (the {gpu.flops(layout.precision) / 1e12:g} TFLOP/s peak x{gpu.power_scale:.3f} at {gpu.power_w:g} W of "
           f"{gpu.rated_power_w:g} W: hardware.POWER_EXPONENT)" if gpu.power_scale < 1 else "")
        + (f" (x{gpu.sustained_fraction:g} of the peak sustained through training steps: hardware.SUSTAINED_HOPPER)"
           if gpu.sustained_fraction < 1 else "") + "; "
        + (f"GEMMs at their shape's rate measured on this board (--kernels {gpu.measured.source}: "
           f"{gpu.measured.reference_tflops:.0f} TFLOP/s at 8192^3, each shape's over it); "
           if gpu.measured is not None else "")
        + ((f"flash attention at {gpu.flash_fraction:.1%} of the peak measured on this board, on its own curve by "
            "rows per call (--kernels); " if gpu.measured is not None and gpu.measured.flash else
            f"flash attention at FlashAttention-2's measured {gpu.flash_fraction:.1%} of the peak (causal, 16k "
            "tokens; hardware.py) on the kernel's curve by rows per call (constants.FLASH_BY_CHUNK); ")
           if attention == "flash" and gpu.flash_fraction else "")
        + (f"attention at cuDNN's fused kernel's {gpu.cudnn_flash_fraction:.1%} of the peak (H100, causal, 16k "
           "tokens; hardware.FLASH_CUDNN_HOPPER) on its curve by rows per call (constants.CUDNN_BY_CHUNK); "
           if attention == "cudnn" else "")
        + (f"attention at FlashAttention's Triton port's {gpu.triton_flash_fraction:.1%} of the peak (A100, causal, "
           "16k tokens; hardware.FLASH_TRITON_AMPERE) on its curve by rows per call (constants.TRITON_BY_CHUNK); "
           if attention == "triton" else "")
        + "element-wise ops by their bytes, "
        + ("compiled (torch.compile fuses them: constants.HIDDEN_PASSES)" if compiled else
           "eager (each op a pass over HBM: constants.EAGER_*; --compile fuses them)")
        + f"; attention {attention}",
        f"links: tp {link['tp']}, cp {link['cp']}, dp {link['dp']}, pp {link['pp']} (mesh order pp, dp, cp, tp: "
        f"tp innermost, cp ranks tp apart, the gradients' dp x cp group too; "
        f"{topo.gpus_per_node} GPUs per node); collectives = NCCL latency model + bytes / bandwidth",
        "tp: 2 all-reduces forward + 2 backward per layer per micro-batch (+2 when recomputing, +1 under "
        "selective recompute: o_proj's, and under SP the all-gathers into attention and MLP); "
        "sequence parallelism moves the same volume as all-gather + reduce-scatter; "
        + ("hidden behind the GEMMs they feed but one block's share (overlap 'tp')" if "tp" in overlap else
           "never overlapped"),
        f"dp: ZeRO-{layout.zero} traffic in model dtype; reduces hidden behind backward up to its length (the "
        "last bucket exposed); ZeRO-3 gathers hidden behind the block before's compute only; the post-step "
        "parameter all-gather (stages 1-2) "
        + ("hidden behind the first forward (overlap 'param_gather')" if "param_gather" in overlap else "exposed")
        + " and, under pipeline stages, the reduce after the schedule "
        + ("hidden behind the last micro-batch's backward (overlap 'grad_reduce')" if "grad_reduce" in overlap
           else "exposed"),
        "pp: one activation and one gradient send per micro-batch per chunk boundary; bubble = "
        "ideal x f/(1-f) with f = schedule's idle fraction (p-1)/(v·m + p-1); the busiest stage sets the pace",
        f"offload: PCIe {HOST_LINK_BYTES_PER_S / 1e9:g} GB/s, NVMe {NVME_READ_BYTES_PER_S / 1e9:g}/"
        f"{NVME_WRITE_BYTES_PER_S / 1e9:g} GB/s read/write, CPU Adam {CPU_ADAM_PARAMS_PER_S:.3g} params/s; "
        "not overlapped (an upper estimate); offloaded activations go down in forward and up in backward",
    )
