"""GPUs and links as data: the figures the planner's cost model prices a layout with.

Peak FLOP/s are dense (no 2:4 sparsity) tensor-core figures from the public datasheets;
"fp32" is the TF32 tensor-core figure where the GPU has TF32 (PyTorch uses it for fp32
matmuls when `torch.backends.cuda.matmul.allow_tf32` is on), else plain fp32. Link
bandwidths are per GPU, one direction, and what NCCL-style collectives achieve
(bus bandwidth), not the signalling rate. All of them are estimates to check against
`benchmarks/` on the real machine.

GPU memory is in binary units: NVIDIA's "80GB" HBM is 80 GiB.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field
from fractions import Fraction

T = 1e12
GiB = 2 ** 30


@dataclass(frozen=True)
class GPU:
    name: str
    memory_bytes: int
    peak_flops: dict = field(hash=False)  # precision -> dense FLOP/s; a missing key means "not supported"
    hbm_bytes_per_s: float
    form: str = ""                # "SXM" (NVLink baseboard) or "PCIe" (a card): which link a node's GPUs share
    # the board's power limit as run (W) and the one its datasheet peaks are given at (its TDP): a board capped
    # below its TDP sustains fewer FLOP/s (sustained_flops); its streaming multiprocessors (recorded, not priced)
    power_w: float | None = None
    sms: int | None = None
    rated_power_w: float | None = None
    # FlashAttention-2's causal forward + backward throughput (head dim 128, 16k tokens, the FLOPs of the causal
    # half) as a fraction of the dense 16-bit peak, measured on this architecture; None where unmeasured
    flash_fraction: float | None = None
    # cuDNN's fused flash attention (Transformer Engine's on Hopper), the same measure; None where unmeasured
    cudnn_flash_fraction: float | None = None
    # FlashAttention's Triton port (flash_attn_triton.py: llm-foundry's attn_impl "triton"), the same measure
    triton_flash_fraction: float | None = None
    # the best-shape 16-bit matmul's measured fraction of the dense peak (MAMF), where measured: GEMMs are priced
    # at constants.GEMM_EFFICIENCY x this / A100 SXM's (gemm_scale), the GPU the efficiency was checked on
    matmul_fraction: float | None = None
    # the fraction of the datasheet's tensor-core peak the board keeps up through training steps at its rated
    # power (the datasheet counts its boost clock), where published runs have measured it: SUSTAINED_HOPPER
    sustained_fraction: float = 1.0
    # kernels measured on this board (planner/kernels.py, `plan --kernels`): GEMMs priced by shape, flash
    # attention by its own curve; None: the constants' sources
    measured: object = field(default=None, hash=False, compare=False, repr=False)

    def attention_fraction(self, kernel: str) -> float | None:
        """The published forward + backward fraction of the peak of attention kernel `kernel` ("flash", "cudnn",
        "triton") on this board; None where unmeasured."""
        return {"flash": self.flash_fraction, "cudnn": self.cudnn_flash_fraction,
                "triton": self.triton_flash_fraction}[kernel]

    def flops(self, precision: str) -> float:
        """Dense peak FLOP/s for `precision` (the datasheet's: what MFU is counted against); a clear error where
        the chip lacks it (bf16 on V100)."""
        if precision not in self.peak_flops:
            fix = "fp16" if "fp16" in self.peak_flops else next(iter(self.peak_flops))
            raise ValueError(f"GPU {self.name!r} has no {precision} support (it has {', '.join(self.peak_flops)}); "
                             f"use precision {fix!r} ({self.peak_flops[fix] / T:g} TFLOP/s) instead")
        return self.peak_flops[precision]

    @property
    def power_scale(self) -> float:
        """The fraction of the datasheet peak a board capped at `power_w` below its rated TDP sustains:
        (power_w / rated_power_w) ** POWER_EXPONENT (1 at or above the TDP, or where either is unknown)."""
        if not self.power_w or not self.rated_power_w or self.power_w >= self.rated_power_w:
            return 1.0
        return (self.power_w / self.rated_power_w) ** POWER_EXPONENT

    def sustained_flops(self, precision: str) -> float:
        """The peak the board's power limit allows: what the cost model prices tensor-core work against."""
        return self.flops(precision) * self.power_scale * self.sustained_fraction

    @property
    def gemm_scale(self) -> float:
        """This GPU's best-shape matmul efficiency over A100 SXM's (MAMF_A100); 1 where unmeasured."""
        return self.matmul_fraction / MAMF_A100 if self.matmul_fraction else 1.0


# Tensor-core throughput against the board's power limit, from two datasheets of the same GH100 die with the same
# 132 SMs: H100 NVL 835 dense bf16 TFLOP/s at 400 W (1,671 with sparsity; 350-400 W) and H100 SXM5 989 at 700 W.
# ln(989 / 835) / ln(700 / 400) = 0.30: throughput goes as about the cube root of power (the clock as f, dynamic
# power as f V^2 with V rising with f). A 500 W SXM H100 (Meta's Grand Teton) sustains (500/700)^0.30 = 0.90 of
# the SXM peak, between the SXM and NVL figures as torchtitan's benchmark notes say.
POWER_EXPONENT = 0.30


def _gpu(name, gib, bf16, fp16, fp32, hbm_tb_s, form, watts, sms, flash=None, mamf=None, sustained=1.0,
         cudnn=None, triton=None) -> GPU:
    flops = {k: v * T for k, v in (("bf16", bf16), ("fp16", fp16), ("fp32", fp32)) if v is not None}
    return GPU(name, int(gib * GiB), flops, hbm_tb_s * T, form, watts, sms, rated_power_w=watts,
               flash_fraction=flash, matmul_fraction=mamf, sustained_fraction=sustained, cudnn_flash_fraction=cudnn,
               triton_flash_fraction=triton)


# Maximum achievable matmul FLOPS (bf16, the best of a sweep of shapes, torch.matmul) over the dense peak,
# stas00/ml-engineering compute/accelerator/README.md "Maximum Achievable Matmul FLOPS comparison table" (commit
# 744d01e1): A100 SXM 271.2 of 312 (86.9%), A100 PCIe 252.9 (81.1%, its 300 W), H100 SXM 794.5 of 989 (80.3%,
# "H200 is the same"). The H100 reaches less of its datasheet peak than the A100 of its own.
MAMF_A100, MAMF_A100_PCIE, MAMF_H100 = 271.2 / 312, 252.9 / 312, 794.5 / 989


# FlashAttention-2's causal forward + backward at head dim 128 and 16k tokens (the FLOPs of the causal half):
# 189 TFLOP/s on A100 80GB SXM4 (of 312) and 328 on H100 SXM5 (of 989), Dao-AILab/flash-attention README.md,
# assets/flash2_a100_fwd_bwd_benchmark.png and flash2_h100_fwd_bwd_benchmark.png (commit 4f285b35, July 2023).
# The kernel does not use Hopper's asynchronous tensor cores (FlashAttention-3 and cuDNN's do): a third of the
# H100's peak against three fifths of the A100's. Ampere boards share the A100 figure, Hopper boards the H100's.
FLASH_AMPERE, FLASH_HOPPER = 189 / 312, 328 / 989
# FlashAttention's Triton port in the same A100 figure (its "FlashAttention Triton" bars, causal, head dim 128):
# 50/61/68/74/78/80 TFLOP/s from 512 to 16k tokens, 0.42x FlashAttention-2 at 16k. The figure for H100 has no such
# bar: the port is priced on Ampere boards only.
FLASH_TRITON_AMPERE = 80 / 312

# cuDNN's fused flash attention on H100 SXM5 at head dim 128, the FlashAttention-3 paper's figures (Shah et al.
# 2024, arXiv:2407.08608; the forward one is Dao-AILab/flash-attention assets/flash3_fp16_fwd.png): causal forward
# 315/410/484/518/529/539 TFLOP/s from 512 to 16k tokens where FlashAttention-2 runs 191/260/298/319/333/335, and
# backward 305/408/465/499/518/516 against 214/260/291/310/318/322. Forward + backward (the backward's 2.5x FLOPs)
# at 16k: 522 TFLOP/s, 1.60x FlashAttention-2's 326 from the same figures (whose own fwd + bwd figure, above, is
# 328). Transformer Engine runs it in place of FlashAttention-2 on Hopper (TE 1.5 on: "Disabling FlashAttention to
# give FusedAttention preference on Hopper+ for performance reasons"), so Megatron-Core's and NeMo's runs do.
FLASH_CUDNN_HOPPER = 522 / 989


# What an SXM Hopper board keeps of its tensor-core peak through training steps, beside the figures above (each
# measured in short runs of one kernel): fitted to Megatron-Core r0.8.0's nine H100 runs (README at f2e5db40,
# 700 W, with the communication overlaps its README ran priced, and Transformer Engine's cuDNN attention), the
# least-squares fit of their log errors to 0.01 (tests/test_planner_published.py re-fits it and fails when it
# drifts; with their attention priced as FlashAttention-2 the fit was 0.86). Held out of the fit: torchtitan's
# seven runs on 500 W Grand Teton H100s. A100 parts need no such figure: Megatron-LM 2021's and
# torchtitan's A100 runs are priced within 9% without it, but for one bound by its network (RESULTS.md).
SUSTAINED_HOPPER = 0.83


GPUS = {g.name: g for g in (
    # name, memory GiB, bf16, fp16, fp32 (TF32 where it exists), HBM TB/s, form factor, power limit W, SMs,
    # FlashAttention-2's and the best matmul's measured fractions of the peak (where measured: above).
    # Dense figures (half the datasheets' "with sparsity" ones); SMs from the architecture whitepapers
    # (GH100: 132 on the SXM5 part, 114 on the PCIe card; GA100: 108; AD102: 142 on L40S, 128 on the 4090;
    # GA102: 72 on A10; GV100: 80).
    # H100 Tensor Core GPU datasheet, SXM5 column; the PCIe column (300-350 W); H200 datasheet, SXM column
    _gpu("h100", 80, 989, 989, 494.5, 3.35, "SXM", 700, 132, FLASH_HOPPER, MAMF_H100, SUSTAINED_HOPPER,
         cudnn=FLASH_CUDNN_HOPPER),
    _gpu("h100-pcie", 80, 756, 756, 378, 2.0, "PCIe", 350, 114, FLASH_HOPPER, MAMF_H100, cudnn=FLASH_CUDNN_HOPPER),
    _gpu("h200", 141, 989, 989, 494.5, 4.8, "SXM", 700, 132, FLASH_HOPPER, MAMF_H100, SUSTAINED_HOPPER,
         cudnn=FLASH_CUDNN_HOPPER),
    # A100 Tensor Core GPU datasheet: 80GB SXM, 80GB PCIe, 40GB SXM
    _gpu("a100", 80, 312, 312, 156, 2.039, "SXM", 400, 108, FLASH_AMPERE, MAMF_A100, triton=FLASH_TRITON_AMPERE),
    _gpu("a100-pcie", 80, 312, 312, 156, 1.935, "PCIe", 300, 108, FLASH_AMPERE, MAMF_A100_PCIE,
         triton=FLASH_TRITON_AMPERE),
    _gpu("a100-40gb", 40, 312, 312, 156, 1.555, "SXM", 400, 108, FLASH_AMPERE, MAMF_A100, triton=FLASH_TRITON_AMPERE),
    _gpu("l40s", 48, 362, 362, 183, 0.864, "PCIe", 350, 142),   # L40S datasheet
    _gpu("a10", 24, 125, 125, 62.5, 0.6, "PCIe", 150, 72),      # A10 Tensor Core GPU datasheet
    _gpu("v100", 32, None, 125, 15.7, 0.9, "SXM", 300, 80),     # Tesla V100 datasheet, SXM2; no bf16, no TF32
    _gpu("rtx4090", 24, 165.2, 165.2, 82.6, 1.008, "PCIe", 450, 128),  # Ada whitepaper, fp32 accumulate; 450 W TGP
    # Nominal figure for planning CPU test runs (a few cores with AVX2/AVX-512); not a datasheet number.
    GPU("cpu", 24 * GiB, {"bf16": 1e11, "fp16": 1e11, "fp32": 1e11}, 2e10),
)}
# (fp32 above is the TF32 tensor-core figure where the chip has TF32; V100's is plain fp32.)

GPU_ALIASES = {
    "h100-sxm": "h100", "h100-sxm5": "h100", "h100-80gb": "h100", "h100-80gb-hbm3": "h100", "h100-sxm5-80gb": "h100",
    "h100-pcie-80gb": "h100-pcie", "h100-80gb-pcie": "h100-pcie",
    "h200-sxm": "h200", "h200-141gb": "h200",
    "a100-pcie-80gb": "a100-pcie", "a100-80gb-pcie": "a100-pcie",
    "a100-80gb": "a100", "a100-sxm": "a100", "a100-sxm4-80gb": "a100", "a100-sxm-80gb": "a100",
    "a100-40g": "a100-40gb", "a100-sxm4-40gb": "a100-40gb", "a100-sxm-40gb": "a100-40gb",
    "l40s-48gb": "l40s",
    "a10-24gb": "a10",
    "v100-sxm2": "v100", "v100-32gb": "v100", "v100-sxm2-32gb": "v100",
    "4090": "rtx4090", "rtx-4090": "rtx4090", "rtx-4090-24gb": "rtx4090",
    "host": "cpu",
}


@dataclass(frozen=True)
class Interconnect:
    name: str
    bytes_per_s: float   # per GPU, one direction, achievable bus bandwidth
    latency_s: float     # per ring step (NCCL's per-hop latency)
    launch_s: float = 0.0   # per collective, whatever its size (NCCL's base latency)


# NCCL's ring latency model (NVIDIA/nccl src/graph/tuning.cc, NCCL 2.8-2.12, ring / Simple protocol):
# baseLat 8.4 us per collective, hwLat 3.4 us per NVLink step, 9.6 us per network step.
NCCL_BASE_LATENCY_S = 8.4e-6
NVLINK_STEP_S, NET_STEP_S, PCIE_STEP_S = 3.4e-6, 9.6e-6, 5.7e-6

INTERCONNECTS = {i.name: i for i in (
    # Intra-node. H100 NVLink4 is 900 GB/s bidirectional = 450 GB/s per direction; we assume
    # collectives reach about that (NCCL with NVLink SHARP on 8 GPUs comes close; plain rings ~80%).
    Interconnect("nvlink", 450e9, NVLINK_STEP_S, NCCL_BASE_LATENCY_S),
    # A100 NVLink3: 600 GB/s bidirectional; NCCL caps an A100 ring's bus bandwidth at 235 GB/s (tuning.cc).
    Interconnect("nvlink3", 235e9, NVLINK_STEP_S, NCCL_BASE_LATENCY_S),
    Interconnect("pcie", 25e9, PCIE_STEP_S, NCCL_BASE_LATENCY_S),   # PCIe gen4 x16: 32 GB/s signalling, ~25
    # Inter-node, per GPU: the node's NIC bandwidth over its GPUs, ~80% of signalling reached by NCCL.
    Interconnect("infiniband", 40e9, NET_STEP_S, NCCL_BASE_LATENCY_S),   # NDR 400 Gb/s per GPU = 50 GB/s
    Interconnect("hdr", 20e9, NET_STEP_S, NCCL_BASE_LATENCY_S),   # HDR 200 Gb/s per GPU = 25 GB/s (DGX A100)
    # Jean Zay (BLOOM): four 100 Gb/s Omni-Path links per 8-GPU node = 6.25 GB/s per GPU signalling.
    Interconnect("omnipath", 5e9, NET_STEP_S, NCCL_BASE_LATENCY_S),
    Interconnect("ethernet", 10e9, 30e-6, NCCL_BASE_LATENCY_S),    # 100 Gb/s = 12.5 GB/s, ~10 achievable
    Interconnect("loopback", 5e9, 50e-6),     # gloo over TCP on one host (CPU test runs)
)}

INTERCONNECT_ALIASES = {
    "nvlink4": "nvlink", "nvl": "nvlink",
    "pcie4": "pcie", "pcie-gen4": "pcie", "pci-e": "pcie",
    "ib": "infiniband", "ndr": "infiniband", "ib-ndr": "infiniband", "ib-hdr": "hdr", "hdr200": "hdr",
    "nvlink-a100": "nvlink3", "opa": "omnipath", "omni-path": "omnipath",
    "eth": "ethernet", "100gbe": "ethernet", "tcp": "ethernet",
    "gloo": "loopback", "localhost": "loopback", "lo": "loopback",
}

# Host-side figures for ZeRO offload. All estimates; measure on the target machine.
HOST_LINK_BYTES_PER_S = 25e9    # GPU<->CPU copies over PCIe gen4 x16 (pinned memory), per GPU
NVME_READ_BYTES_PER_S = 3e9     # one PCIe gen4 NVMe drive, sequential read
NVME_WRITE_BYTES_PER_S = 3e9    # the same drive, sequential write (sustained writes are often lower)
# The offloaded AdamW step on the host, parameters per second per process. In a GPU run bunsan steps the host shard
# with torch's fused CPU AdamW (optim/optimizers.py passes fused=True on CUDA): benchmarks/bench_cpu_adam.py measured
# it at 0.82e9/s on one core of a 2-core Xeon VM, 1.60e9/s on two, as fast as DeepSpeed's CPUAdam beside it
# (RESULTS.md). With a host's processes stepping at once, its memory bandwidth bounds them: 28 bytes per parameter
# (fp32 weight, gradient and moments read, three written), so 8 processes at 1e9/s draw 224 GB/s, within a
# two-socket DDR4/DDR5 server's. 1e9: about one core's rate, below that share.
CPU_ADAM_PARAMS_PER_S = 1e9


def _normalize(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'h100-80gb-hbm3': the form torch.cuda.get_device_name() gives maps too."""
    key = re.sub(r"[\s_]+", "-", str(name).strip().lower())
    return re.sub(r"^(nvidia-|tesla-|geforce-)+", "", key)


def _lookup(kind: str, name: str, table: dict, aliases: dict):
    key = _normalize(name)
    key = aliases.get(key, key)
    if key in table:
        return table[key]
    close = difflib.get_close_matches(key, list(table) + list(aliases), n=1, cutoff=0.5)
    hint = f"; did you mean {aliases.get(close[0], close[0])!r}?" if close else ""
    raise ValueError(f"unknown {kind} {name!r}; known: {', '.join(table)}{hint}")


def gpu_spec(name: str) -> GPU:
    """The GPU named `name` (case-insensitive; aliases like 'h100-sxm', 'a100-80gb', 'NVIDIA A100-SXM4-40GB')."""
    return _lookup("GPU", name, GPUS, GPU_ALIASES)


def interconnect(name: str) -> Interconnect:
    """The link named `name` (case-insensitive; aliases like 'ib', 'nvlink4', 'gloo')."""
    return _lookup("interconnect", name, INTERCONNECTS, INTERCONNECT_ALIASES)


# Decimal units are powers of 1000 (disk and datasheet style); binary units and the bare
# letters K/M/G/T are powers of 1024, as Slurm's --mem=24G and `free -g` read them.
_UNITS = {"": 1, "b": 1,
          "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "tb": 10 ** 12,
          "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30, "tib": 2 ** 40,
          "k": 2 ** 10, "m": 2 ** 20, "g": 2 ** 30, "t": 2 ** 40}
_BYTES_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)(?:e([+-]?\d+))?\s*([a-z]*)\s*$", re.IGNORECASE)
_FORMS = ("plain bytes (1048576), decimal units 80GB = 80*10^9 (KB, MB, GB, TB), "
          "binary units 80GiB = 80G = 80*2^30 (KiB/K, MiB/M, GiB/G, TiB/T)")


def parse_bytes(text) -> int:
    """'80GB' -> 80*10^9, '80GiB' and '80G' -> 80*2^30, '1048576' or 1048576 -> bytes."""
    if isinstance(text, int) and not isinstance(text, bool) and text >= 0:
        return text
    match = _BYTES_RE.match(text) if isinstance(text, str) else None
    unit = match and match.group(3).lower()
    if not match or unit not in _UNITS:
        raise ValueError(f"cannot read {text!r} as a byte size; write {_FORMS}")
    value = Fraction(match.group(1) + (f"e{match.group(2)}" if match.group(2) else "")) * _UNITS[unit]
    if value.denominator != 1:
        raise ValueError(f"{text!r} is {float(value)} bytes, not a whole number of bytes; write {_FORMS}")
    return int(value)


# The NVLink an SXM part's baseboard has; a PCIe card talks to its node's others over PCIe.
INTRA_LINK = {"a100": "nvlink3", "a100-40gb": "nvlink3", "v100": "nvlink3", "cpu": "loopback"}


def intra_link(gpu: GPU) -> Interconnect:
    """The link inside a node that `gpu` comes with: PCIe for a PCIe card; NVLink4 for H100/H200 SXM, NVLink3
    for A100 and V100 SXM."""
    if gpu.form == "PCIe":
        return interconnect("pcie")
    return interconnect(INTRA_LINK.get(gpu.name.rstrip("*"), "nvlink"))


def parse_rate(text) -> float:
    """'6.25GB/s', '6.25GB' or 6.25e9 -> bytes per second (decimal and binary units as parse_bytes)."""
    if isinstance(text, (int, float)) and not isinstance(text, bool) and text > 0:
        return float(text)
    body = text.strip()[:-2] if isinstance(text, str) and text.strip().lower().endswith("/s") else text
    try:
        rate = parse_bytes(body)
    except ValueError:
        raise ValueError(f"cannot read {text!r} as a bandwidth; write bytes per second such as 6.25GB/s, "
                         "25GB or 2.5e10") from None
    if rate <= 0:
        raise ValueError(f"bandwidth {text!r} must be above zero; write e.g. 6.25GB/s")
    return float(rate)


def with_link(link: Interconnect, bandwidth=None, latency=None) -> Interconnect:
    """`link` with a measured bandwidth (bytes/s or '6GB/s') and/or per-step latency (seconds) instead."""
    import dataclasses
    changes = {}
    if bandwidth is not None:
        changes["bytes_per_s"] = parse_rate(bandwidth)
    if latency is not None:
        if isinstance(latency, bool) or not isinstance(latency, (int, float)) or latency < 0:
            raise ValueError(f"link latency must be seconds >= 0, got {latency!r}; write e.g. 1e-5")
        changes["latency_s"] = float(latency)
    if not changes:
        return link
    label = ",".join(f"{k}={v:g}" for k, v in changes.items())
    return dataclasses.replace(link, name=f"{link.name}({label})", **changes)


_FLOPS = re.compile(r"^\s*(\d+(?:\.\d*)?(?:e[+-]?\d+)?)\s*([kmgtp]?)(?:flops?(?:/s)?)?\s*$", re.IGNORECASE)
_FLOP_SCALE = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "p": 1e15}


def _flops(key: str, text: str) -> float:
    m = _FLOPS.match(text)
    if not m or float(m[1]) <= 0:
        raise ValueError(f"--gpu-spec {key}={text!r}: write dense FLOP/s such as {key}=312T or {key}=3.12e14")
    return float(m[1]) * _FLOP_SCALE[m[2].lower()]


def _count(key: str, text: str) -> int:
    """--gpu-spec power=400W / sms=108: a positive whole number (watts with or without the W)."""
    digits = text[:-1] if key == "power" and text.lower().endswith("w") else text
    if not digits.isdigit() or int(digits) <= 0:
        raise ValueError(f"--gpu-spec {key}={text!r}: a positive whole number, e.g. "
                         + ("power=400W" if key == "power" else "sms=108"))
    return int(digits)


def parse_gpu_spec(text: str) -> GPU:
    """'a100,bf16=300T,memory=80GiB,hbm=2TB' -> the named GPU with those figures replaced (a name first, or
    'custom' and every figure given); form=SXM|PCIe, power=400W and sms=108 likewise."""
    import dataclasses
    parts = [p.strip() for p in str(text).split(",") if p.strip()]
    if not parts:
        raise ValueError("--gpu-spec is empty; write NAME[,bf16=312T][,fp16=..][,fp32=..][,memory=80GiB][,hbm=2TB]")
    name, *pairs = parts
    base = GPU("custom", 0, {}, 0.0) if name.lower() == "custom" else gpu_spec(name)
    flops, changes = dict(base.peak_flops), {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        key = key.strip().lower()
        if key in ("bf16", "fp16", "fp32"):
            flops[key] = _flops(key, value.strip())
        elif key == "memory":
            changes["memory_bytes"] = parse_bytes(value.strip())
        elif key == "hbm":
            changes["hbm_bytes_per_s"] = parse_rate(value.strip())
        elif key == "form":
            forms = {"sxm": "SXM", "pcie": "PCIe"}
            if value.strip().lower() not in forms:
                raise ValueError(f"--gpu-spec form={value.strip()!r}: SXM (an NVLink baseboard) or PCIe (a card)")
            changes["form"] = forms[value.strip().lower()]
        elif key in ("power", "sms"):
            changes["power_w" if key == "power" else "sms"] = _count(key, value.strip())
        else:
            raise ValueError(f"--gpu-spec key {key!r} is not one of bf16, fp16, fp32, memory, hbm, form, power, sms; "
                             "write e.g. a100,bf16=312T,memory=80GiB,hbm=2.039TB,form=SXM,power=400W,sms=108")
    gpu = dataclasses.replace(base, name=base.name if not pairs else f"{base.name}*", peak_flops=flops, **changes)
    if not gpu.peak_flops or gpu.memory_bytes <= 0 or gpu.hbm_bytes_per_s <= 0:
        raise ValueError(f"--gpu-spec {text!r} leaves the GPU without FLOP/s, memory or HBM bandwidth; a custom "
                         "GPU needs all three: custom,bf16=312T,memory=80GiB,hbm=2TB")
    return gpu
