"""Published large training runs, as their authors report them, and the planner's view of each.

Shared by benchmarks/bench_planner.py (prints the table) and tests/test_planner_published.py (pins it).
Every figure below is the source's; every assumption a run needed is in its `notes` (and in this docstring
where it is common to a group). Groups, oldest first:

  Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters using Megatron-LM"
  (SC '21). Table 1: GPT models on Selene (DGX A100 80GB, 8 GPUs per node on NVLink3 / NVSwitch, eight
  200 Gb/s HDR InfiniBand HCAs per node), vocabulary 51,200, sequence 2,048 (both confirmed by the
  Megatron-LM README), activation recompute on, teraFLOP/s per GPU counted with the paper's formula
  96·B·s·l·h²·(1 + s/6h + V/16lh), which includes the recomputed forward. Table 2: GPT-3 175B at global
  batch 1536, PTD-P (TP 8, PP 12, micro-batch 1) against ZeRO-3 without model parallelism.
  The table figures are transcribed from the paper (the search tool found the README's model settings but
  no text copy of the tables to check the numbers against).

  BigScience BLOOM-176B (tr11; the "BigScience 176B Model" page and the BLOOM paper, arXiv 2211.05100):
  384 A100 80GB on Jean Zay, 48 nodes of 8, NVLink inside a node, four 100 Gb/s Omni-Path links per node
  (6.25 GB/s per GPU); 70 layers, hidden 14,336, 112 heads, sequence 2,048, global batch 2,048, bf16; TP 4,
  PP 12, DP 8, ZeRO-1, micro-batch 2, recompute (tr11 training script); "about 150 TFLOPs" per GPU
  (Megatron-DeepSpeed's count, the same formula) and ~60 GB per GPU.

  Megatron's GPT blocks have a 4h GELU MLP (8h² parameters); bunsan prices Llama blocks, so each GPT block is
  the Llama block with the same parameters and FLOPs (intermediate 8h/3, rounded to the tensor-parallel size).
  Megatron-LM 2021 and BLOOM used no flash attention: attention "materialized"; their element-wise ops ran as
  Megatron's fused kernels (fused layer norm, bias + GeLU, scale + mask + softmax): priced compiled.

  torchtitan on 64 A100 80GB, April 2024 (pytorch/torchtitan docs/performance.md at 1ea476e9, "Llama 3
  performance numbers" and "Llama 2 performance numbers"): FSDP2 only ("1D parallelism"), local batch 1 or 2,
  tokens per second per GPU ("WPS": train.py divides a rank's tokens by the model-parallel size) and MFU
  against 312 TFLOP/s. Settings from the same commit's train_configs/*.toml: sequence 8,192 (Llama 3) and 4,096
  (Llama 2), `compile = false` (eager), bf16 parameters (torchtitan's FSDP2 mixed precision), selective "op"
  checkpointing = torchtitan's per-op policy (parallelize_llama.py: save every matmul's output but every second
  one, and SDPA's; priced as bunsan's selective recompute, which reruns the attention core: the recomputed
  FLOPs differ by about a sixth of that term, 1-2% of a step). Assumed: the cluster's network (not published;
  priced as DGX A100's eight 200 Gb/s HDR links per node), and PyTorch SDPA's flash kernel (FlashAttention-2).
  Left out: "selective layer" checkpointing (every second block recomputed whole: bunsan has no such mode) and
  the Llama 2 70B rows' 2D (FSDP + TP) loss curves (no throughput given).

  torchtitan on H100, Meta's Grand Teton (96 GB HBM2e at 2.4 TB/s, the default 500 W power limit of the 700 W
  part, 400 Gb/s RDMA per GPU, 8 GPUs per host on NVLink): (a) docs/performance.md at 3faaa1a0 (August 2024):
  Llama 3.1 405B on 128 GPUs, FSDP 16 x TP 8, local batch 2, full checkpointing, "Optimizations: None", 109
  WPS (29.0% MFU), the figure pytorch/torchtitan PR #481 reported ("wps: 109 mfu: 29%", July 2024) "with
  current config": that PR's train_configs/llama3_405b.toml (commit 48713581): sequence 8,192, `compile =
  false` (eager: the later preset's compile true came with async TP and Float8, the table's other two rows),
  TP with sequence parallelism (torchtitan's TP always shards the norms). (b) benchmarks/llama3_h100_202412_torchtitan.md at 820504e2 (December 2024, torchtitan
  9dec370): Llama 3.1 8B, FSDP on 8 and 128 GPUs, local batch 2, selective checkpointing, eager and
  torch.compile (the Float8 rows are left out: fp8 GEMMs are not priced; so are Tables 2 and 4-6, all Float8:
  context parallelism at 32k-262k, 70B 2D, 405B 3D/4D); sequence 8,192 and the per-op policy from 9dec370's
  train_configs/llama3_8b.toml. (c) benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md at 2887250b (June 2025,
  torchtitan 820504e): the bf16 "vanilla TP" rows: Llama 3 70B on 256 GPUs (FSDP 32, TP 8, compile, full
  checkpointing, local batch 16: 597.3 tokens/s) and Llama 3 8B on 64 (FSDP 8, TP 8, compile, per-op
  checkpointing, local batch 12: 4,378); sequence 8,192 from 820504e's llama3 train configs. Tokens per second
  are per GPU (torchtitan's "tps": a rank's tokens over the non-data-parallel size). Assumed: SDPA's flash
  kernel is FlashAttention-2 (PyTorch's default order of the time; cuDNN attention not picked).

  Megatron-Core r0.8.0 on H100, July 2024 (NVIDIA/Megatron-LM README.md "Training Speed and Scalability" at
  f2e5db40 and its images/model_table.png): GPT models of 1.7B-462B parameters on 48-6,144 H100 GPUs, vocabulary
  131,072, sequence 4,096, weak-scaled batch, TP x PP x DP as tabulated; "Per-GPU teraFLOP/s" counted by
  megatron/training/training.py num_floating_point_operations (r0.8.0: 12·B·s·l·h²·(2 + s/h + 4 + V/2lh) for
  a GPT with a 4h GELU MLP and no recompute term; 408.8 of 989 = 41% MFU, as tabulated). The model sizes fit an
  untied embedding (1.7B = 12·24·2048² + 2·131072·2048). With the README's overlaps: data-parallel
  (--overlap-grad-reduce --overlap-param-gather), tensor-parallel (--tp-comm-overlap) and pipeline
  communication. Assumed (not published): bf16 (the MFU is against the bf16 peak), micro-batch 1, no activation
  recompute, sequence parallelism with TP, the distributed optimizer (ZeRO-1), 1F1B without virtual stages,
  DGX H100 nodes (NVLink4, eight 400 Gb/s NDR links), and Transformer Engine's attention on Hopper: cuDNN's fused
  kernel, which TE 1.5 and later (April 2024 on; core_r0.8.0 is July 2024) prefers to FlashAttention-2 on sm90
  (transformer_engine/pytorch/attention.py: "give FusedAttention preference on Hopper+ for performance reasons"),
  priced at its H100 figure (hardware.FLASH_CUDNN_HOPPER).

Held out (tests/published_llama3.py): the Llama 3 paper's Table 4 (405B on 8,192-16,384 H100, TP 8 x CP x PP 16
x DP), priced, not ranked. Not added: Megatron-LM's strong-scaling figure (GPT-3 175B, 96-4,608 GPUs) gives MFU
47% -> 42% without its layouts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from bunsan.estimator.hardware import interconnect, parse_gpu_spec
from bunsan.estimator.layout import Layout
from bunsan.models.llama import LlamaConfig
from bunsan.planner import constants as K
from bunsan.planner.compute import block_time, gemm
from bunsan.planner.cost import stage_blocks, step_time
from bunsan.planner.search import plan
from bunsan.planner.space import Space

# What the authors' software could run. Megatron-LM 2021: tensor, pipeline (1F1B, interleaved) and data
# parallelism, full recompute in every Table 1 and 2 run, no sequence parallelism (Korthikanti et al. 2022),
# no ZeRO. Megatron-DeepSpeed (BLOOM): the same plus ZeRO-1 (its pipeline engine runs no ZeRO-2/3).
# Neither offloaded activations to the host.
MEGATRON_2021 = Space(zero=(0,), recompute=("full",), sequence_parallel=(False,), offload=("none",), cp=(1,),
                      activation_offload=False)
MEGATRON_DEEPSPEED = Space(zero=(0, 1), recompute=("full",), sequence_parallel=(False,), offload=("none",), cp=(1,),
                           activation_offload=False)
# torchtitan, April 2024: FSDP2 and tensor parallelism (torchtitan's TP plan shards the norms: sequence
# parallelism; TP without it is searched too, a superset), no context parallelism yet, every checkpointing
# mode, no offload. December 2024 on: also pipeline (1F1B, interleaved) and context parallelism. Its only
# offload at these commits is FSDP2's CPUOffloadPolicy (parameters, gradients, optimizer states; not searched):
# no activation offload.
TORCHTITAN_2024 = Space(zero=(3,), offload=("none",), cp=(1,), schedules=("1f1b",), activation_offload=False)
TORCHTITAN = Space(zero=(3,), offload=("none",), activation_offload=False)
# Megatron-Core r0.8.0: TP (with sequence parallelism; without it searched too), PP (1F1B, interleaved), CP, the
# distributed optimizer (ZeRO-1) or plain data parallelism, activation offload to the host (its cpu_offloading).
MEGATRON_CORE = Space(zero=(0, 1), offload=("none",))

# Sources, by repository, path and commit (short; COMMITS has the full hashes)
TT_A100 = "pytorch/torchtitan docs/performance.md @1ea476e9"
TT_405B = "pytorch/torchtitan docs/performance.md @3faaa1a0"
TT_DEC24 = "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md @820504e2"
TT_JUN25 = "pytorch/torchtitan benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md @2887250b"
MCORE = "NVIDIA/Megatron-LM README.md + images/model_table.png @f2e5db40"
COMMITS = {
    "1ea476e9": "1ea476e9f24be439eda358aa864f45c1c37a8a88", "3faaa1a0": "3faaa1a0dee68ce028400e3dafd1735d152cb4f8",
    "820504e2": "820504e20d1149fbf0b98c567af24c4b0433b22d", "2887250b": "2887250bbd9103d0bc997ea2efb3a525b5e5dbc0",
    "9dec370a": "9dec370ad26b5f8e9a7333a0e36165018262644b", "f2e5db40": "f2e5db402c44ae309aa6448bcb4ae87e8ae0f5f4",
    "core_r0.8.0": "baf94af3c667248865f23df73b9fb8e2395e6fd0", "48713581": "48713581479319a15f4d10c05b450ad0b9f796bd"}
# Grand Teton's H100 as torchtitan describes it: 96 GB HBM2e at 2.4 TB/s, run at 500 W (the part's TDP is 700 W)
GRAND_TETON = "h100,memory=96GiB,hbm=2.4TB,power=500W"


def gpt(hidden: int, layers: int, heads: int, vocab: int = 51200, tp: int = 8, seq: int = 2048,
        tied: bool = True) -> LlamaConfig:
    inter = 8 * hidden // 3 // tp * tp
    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                       num_attention_heads=heads, max_position_embeddings=seq, tie_word_embeddings=tied)


def llama(hidden: int, layers: int, heads: int, kv: int, inter: int, vocab: int) -> LlamaConfig:
    """torchtitan's Llama flavours (models/llama/__init__.py): intermediate from ffn_dim_multiplier and
    multiple_of as torchtitan rounds it; untied embeddings."""
    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=131072)


LLAMA3_8B = llama(4096, 32, 32, 8, 14336, 128256)
LLAMA3_70B = llama(8192, 80, 64, 8, 28672, 128256)
LLAMA3_405B = llama(16384, 126, 128, 8, 53248, 128256)
LLAMA2_13B = llama(5120, 40, 40, 40, 13824, 32000)
LLAMA2_70B = llama(8192, 80, 64, 8, 28672, 32000)


@dataclass(frozen=True)
class Run:
    name: str
    source: str
    model: LlamaConfig
    gpus: int
    global_batch: int
    layout: Layout                 # what the authors ran
    measured: float                # per GPU, in `unit`: TFLOP/s (the source's count, `count`) or tokens/s
    inter_node: str
    precision: str
    gpu: str = "a100"              # a GPU name, or a --gpu-spec string for a board the table lacks
    space: Space = MEGATRON_2021   # what the authors could have picked instead
    ranked: bool = True            # False: priced only (a layout nobody would pick, kept for its trend)
    notes: tuple = field(default=())
    intra: str = "nvlink3"
    attention: str = "materialized"
    compiled: bool = True          # element-wise ops fused (torch.compile, Megatron's fused kernels)
    count: str = "megatron2021"    # the FLOP count of `measured`: megatron2021, megatron2024, palm, or "tokens"
    group: str = "Megatron-LM 2021"
    sac: bool = False              # torchtitan's per-op selective checkpointing (layout says "selective")
    overlap: tuple = ()            # the communication its software overlapped (cost.OVERLAPS)

    @property
    def unit(self) -> str:
        return "tokens/s" if self.count == "tokens" else "TFLOP/s"

    @property
    def seq_len(self) -> int:
        return self.layout.seq_len


def _ptd(dp, tp, pp, mb, batch, zero=0) -> Layout:
    return Layout(dp=dp, tp=tp, pp=pp, zero=zero, micro_batch=mb, grad_accum=batch // (dp * mb), seq_len=2048,
                  precision="fp16", checkpointing=True)


def _fsdp(gpus, lbs, seq, ckpt, tp=1) -> Layout:
    """torchtitan's FSDP (x TP): `lbs` rows per data-parallel rank, one micro-batch (torchtitan accumulates none)."""
    return Layout(dp=gpus // tp, tp=tp, zero=3, micro_batch=lbs, grad_accum=1, seq_len=seq, precision="bf16",
                  checkpointing=ckpt, sequence_parallel=tp > 1)


# The README's overlaps: --overlap-grad-reduce --overlap-param-gather, --tp-comm-overlap
MCORE_OVERLAPS = ("tp", "grad_reduce", "param_gather")


def _mcore(tp, pp, dp, batch) -> Layout:
    return Layout(dp=dp, tp=tp, pp=pp, zero=1, micro_batch=1, grad_accum=batch // dp, seq_len=4096, precision="bf16",
                  checkpointing="none", sequence_parallel=tp > 1)


GPT3 = gpt(12288, 96, 96)
BLOOM = gpt(14336, 70, 112, vocab=250880, tp=4)
T1, T2 = "Narayanan et al. 2021, Table 1", "Narayanan et al. 2021, Table 2"


def _tt_a100(name, model, lbs, seq, ckpt, measured) -> Run:
    return Run(name, TT_A100, model, 64, 64 * lbs, _fsdp(64, lbs, seq, ckpt), measured, "hdr", "bf16",
               space=TORCHTITAN_2024, attention="flash", compiled=False, count="tokens",
               group="torchtitan A100 2024", sac=ckpt == "selective",
               notes=("network not published: DGX A100's 8 x HDR 200 Gb/s assumed",)
               + ((SELECTIVE_OP,) if ckpt == "selective" else ()))


def _tt_h100(name, source, model, gpus, lbs, seq, ckpt, compiled, measured, tp=1, notes=()) -> Run:
    return Run(name, source, model, gpus, gpus // tp * lbs, _fsdp(gpus, lbs, seq, ckpt, tp), measured, "infiniband",
               "bf16", gpu=GRAND_TETON, space=TORCHTITAN, intra="nvlink", attention="flash", compiled=compiled,
               count="tokens", group="torchtitan H100 500 W", sac=ckpt == "selective",
               notes=tuple(notes) + ((SELECTIVE_OP,) if ckpt == "selective" else ()))


def _mcore_run(size, heads, hidden, layers, tp, pp, dp, gpus, batch, tflops) -> Run:
    return Run(f"GPT {size}, {gpus} H100", MCORE, gpt(hidden, layers, heads, vocab=131072, tp=tp, seq=4096,
                                                       tied=False),
               gpus, batch, _mcore(tp, pp, dp, batch), tflops, "infiniband", "bf16", gpu="h100",
               space=MEGATRON_CORE, intra="nvlink", attention="cudnn", compiled=True, count="megatron2024",
               group="Megatron-Core H100 2024", overlap=MCORE_OVERLAPS,
               notes=("micro-batch 1, no recompute, SP, distributed optimizer, 1F1B, DGX H100 network assumed",))


SELECTIVE_OP = ("torchtitan's per-op checkpointing: every second matmul of a block (wk, wo, w3) and its "
                "element-wise ops rerun in backward (sac_recompute)")

RUNS = (
    Run("GPT 1.7B, 32 A100", T1, gpt(2304, 24, 24), 32, 512, _ptd(32, 1, 1, 8, 512), 137, "hdr", "fp16",
        notes=("micro-batch not published; 8 assumed",)),
    Run("GPT 18.4B, 256 A100", T1, gpt(6144, 40, 48), 256, 1024, _ptd(32, 8, 1, 8, 1024), 135, "hdr", "fp16",
        notes=("micro-batch not published; 8 assumed",)),
    Run("GPT 145.6B, 1536 A100", T1, gpt(12288, 80, 96), 1536, 2304, _ptd(24, 8, 8, 1, 2304), 148, "hdr",
        "fp16", notes=("micro-batch not published; 1 assumed",)),
    Run("GPT-3 175B, 384 A100", T2, GPT3, 384, 1536, _ptd(4, 8, 12, 1, 1536), 153, "hdr", "fp16"),
    Run("GPT-3 175B, 768 A100", T2, GPT3, 768, 1536, _ptd(8, 8, 12, 1, 1536), 149, "hdr", "fp16"),
    Run("GPT-3 175B, 1536 A100", T2, GPT3, 1536, 1536, _ptd(16, 8, 12, 1, 1536), 141, "hdr", "fp16"),
    Run("BLOOM-176B, 384 A100", "BigScience tr11", BLOOM, 384, 2048,
        Layout(dp=8, tp=4, pp=12, zero=1, micro_batch=2, grad_accum=128, seq_len=2048, precision="bf16",
               checkpointing=True), 150, "omnipath", "bf16", space=MEGATRON_DEEPSPEED, group="BLOOM 2022"),
    Run("GPT-3 175B ZeRO-3, 384 A100", T2, GPT3, 384, 1536, _ptd(384, 1, 1, 4, 1536, zero=3), 144, "hdr", "fp16",
        ranked=False),
    Run("GPT-3 175B ZeRO-3, 768 A100", T2, GPT3, 768, 1536, _ptd(768, 1, 1, 2, 1536, zero=3), 88, "hdr", "fp16",
        ranked=False, notes=("micro-batch 2: 1536 samples over 768 GPUs",)),
    Run("GPT-3 175B ZeRO-3, 1536 A100", T2, GPT3, 1536, 1536, _ptd(1536, 1, 1, 1, 1536, zero=3), 44, "hdr",
        "fp16", ranked=False, notes=("micro-batch 1: 1536 samples over 1536 GPUs",)),
    # torchtitan, 64 A100 80GB, eager, FSDP only (April 2024)
    _tt_a100("Llama 3 8B FSDP, 64 A100", LLAMA3_8B, 1, 8192, "selective", 2973),
    _tt_a100("Llama 3 70B FSDP, 64 A100", LLAMA3_70B, 1, 8192, "full", 331),
    _tt_a100("Llama 2 13B FSDP, 64 A100", LLAMA2_13B, 2, 4096, "none", 2162),
    _tt_a100("Llama 2 13B FSDP sel, 64 A100", LLAMA2_13B, 2, 4096, "selective", 1904),
    _tt_a100("Llama 2 70B FSDP sel mb1, 64 A100", LLAMA2_70B, 1, 4096, "selective", 355),
    _tt_a100("Llama 2 70B FSDP mb2, 64 A100", LLAMA2_70B, 2, 4096, "full", 353),
    # torchtitan, Grand Teton H100 at 500 W
    _tt_h100("Llama 3.1 405B FSDP16 TP8, 128 H100", TT_405B, LLAMA3_405B, 128, 2, 8192, "full", False, 109, tp=8,
             notes=("eager: the config PR #481 measured 109 WPS with (compile = false)",)),
    _tt_h100("Llama 3.1 8B FSDP eager, 8 H100", TT_DEC24, LLAMA3_8B, 8, 2, 8192, "selective", False, 5762),
    _tt_h100("Llama 3.1 8B FSDP compiled, 8 H100", TT_DEC24, LLAMA3_8B, 8, 2, 8192, "selective", True, 6667),
    _tt_h100("Llama 3.1 8B FSDP eager, 128 H100", TT_DEC24, LLAMA3_8B, 128, 2, 8192, "selective", False, 5605),
    _tt_h100("Llama 3.1 8B FSDP compiled, 128 H100", TT_DEC24, LLAMA3_8B, 128, 2, 8192, "selective", True, 6514),
    _tt_h100("Llama 3 70B FSDP32 TP8, 256 H100", TT_JUN25, LLAMA3_70B, 256, 16, 8192, "full", True, 597.3, tp=8),
    _tt_h100("Llama 3 8B FSDP8 TP8, 64 H100", TT_JUN25, LLAMA3_8B, 64, 12, 8192, "selective", True, 4378, tp=8),
    # Megatron-Core r0.8.0 weak scaling on H100 (July 2024)
    _mcore_run("1.7B", 16, 2048, 24, 1, 1, 48, 48, 192, 408.8),
    _mcore_run("7.1B", 32, 4096, 30, 2, 1, 48, 96, 192, 465.9),
    _mcore_run("16B", 48, 6144, 32, 4, 1, 48, 192, 192, 489.1),
    _mcore_run("32B", 56, 7168, 48, 8, 1, 48, 384, 192, 459.6),
    _mcore_run("70B", 64, 8192, 84, 8, 2, 48, 768, 384, 419.7),
    _mcore_run("119B", 80, 10240, 92, 8, 4, 48, 1536, 768, 420.5),
    _mcore_run("177B", 96, 12288, 96, 8, 6, 48, 2304, 1152, 432.8),
    _mcore_run("314B", 128, 16384, 96, 8, 8, 48, 3072, 1536, 474.4),
    _mcore_run("462B", 144, 18432, 112, 8, 16, 48, 6144, 3072, 459.9),
)


# torchtitan's async TP (the June 2025 table's "Async TP tokens/sec", bf16): the two vanilla-TP runs above rerun
# with PyTorch's async tensor parallelism, which overlaps TP's all-gathers and reduce-scatters with the matmuls
# they feed (priced with overlap "tp"; tests/test_planner_published.py compares the speedups)
ASYNC_TP = {"Llama 3 70B FSDP32 TP8, 256 H100": 652.4, "Llama 3 8B FSDP8 TP8, 64 H100": 4809.4}


def async_tp_speedups() -> dict:
    """name -> (measured async / vanilla TP throughput, the same ratio priced with overlap "tp")."""
    out = {}
    for name, measured in ASYNC_TP.items():
        run = next(r for r in RUNS if r.name == name)
        vanilla = reproduce(run, search_too=False).predicted
        overlapped = reproduce(dataclasses.replace(run, overlap=("tp",)), search_too=False).predicted
        out[name] = (measured / run.measured, overlapped / vanilla)
    return out


def megatron_flops(model: LlamaConfig, batch: int, seq: int) -> float:
    """FLOPs per step as the Megatron-LM 2021 paper counts them (with the recomputed forward)."""
    b, s, l, h, v = batch, seq, model.num_hidden_layers, model.hidden_size, model.vocab_size
    return 96 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))


def megatron_core_flops(model: LlamaConfig, batch: int, seq: int) -> float:
    """FLOPs per step as Megatron-Core r0.8.0 counts a GPT's (training.py num_floating_point_operations: a 4h
    GELU MLP, multi-head attention, the untied logit layer; no recompute term)."""
    b, s, l, h, v = batch, seq, model.num_hidden_layers, model.hidden_size, model.vocab_size
    return 12 * b * s * l * h * h * (2 + s / h + 4 + v / (2 * l * h))


def palm_flops(model: LlamaConfig, batch: int, seq: int) -> float:
    """FLOPs per step as PaLM (Chowdhery et al. 2022, appendix B) and torchtitan count them: 6N + 12·L·h·s a token,
    N without the input embedding, causal attention counted whole, no recompute term."""
    n, l, h = model.num_params(include_embedding=False), model.num_hidden_layers, model.hidden_size
    return batch * seq * (6 * n + 12 * l * h * seq)


def per_gpu(run: Run, seconds: float) -> float:
    """`run`'s metric for a step of `seconds`: TFLOP/s per GPU in the source's count, or tokens/s per GPU."""
    if run.count == "tokens":
        return run.global_batch * run.seq_len / seconds / run.gpus
    count = {"megatron2021": megatron_flops, "megatron2024": megatron_core_flops, "palm": palm_flops}[run.count]
    return count(run.model, run.global_batch, run.seq_len) / seconds / run.gpus / 1e12


@dataclass
class Reproduction:
    run: Run
    predicted: float               # the planner's price of the published layout, in the run's unit
    rank: int | None               # of the published layout among those that fit (1 = first choice)
    ranked: int                    # layouts that fit
    first: Layout | None
    first_predicted: float | None
    published_peak_gib: float | None = None
    step: object = None            # the published layout's StepTime
    plan: object = None            # the search (None without it)
    searched_step: float | None = None   # the published layout's step as the search prices it (`plan --explain`)

    @property
    def error(self) -> float:
        return self.predicted / self.run.measured - 1

    @property
    def behind_first(self) -> float | None:
        """How much slower the planner thinks the published layout is than its first choice, both priced as the
        search prices them (what `plan --explain` compares: bunsan's recompute modes, so torchtitan's per-op
        checkpointing as bunsan's selective)."""
        if self.first_predicted is None or self.searched_step is None:
            return None
        return 1 - self.plan.best.step.total / self.searched_step


def _same(a: Layout, b: Layout) -> bool:
    keys = ("dp", "tp", "pp", "cp", "zero", "micro_batch", "checkpointing", "schedule", "virtual_stages",
            "sequence_parallel", "offload_optimizer", "offload_param", "offload_blocks")
    return all(getattr(a, k) == getattr(b, k) for k in keys)


def sac_recompute(run: Run, layout: Layout) -> float:
    """Seconds per step torchtitan's per-op selective checkpointing reruns (parallelize_llama.py's policy: every
    matmul's output is saved but every second one's, counted per block in forward order wq, wk, wv, wo, w1, w3,
    w2, so wk, wo and w3 rerun; SDPA's output is saved; the element-wise ops, saved by nothing, all rerun), on
    the busiest pipeline stage. bunsan's own selective recompute reruns the attention core instead: about as
    much at 8k tokens, a third as much at 4k. (Under tensor parallelism the all-gathers that feed the rerun
    matmuls are not added.)"""
    gpu = parse_gpu_spec(run.gpu)
    m, t, h = run.model, layout.tp, run.model.hidden_size
    local = dataclasses.replace(layout, checkpointing="none")
    tokens, d, p, nb, eff = local.micro_batch * local.seq_len, m.head_dim, local.precision, local.dtype_bytes, \
        K.GEMM_EFFICIENCY

    def mm(k, n):
        return gemm(tokens, k, n, gpu, p, nb, eff)
    gemms = mm(h, m.num_attention_heads * d // t) + 2 * mm(h, m.num_key_value_heads * d // t) + mm(h // t, h) + \
        2 * mm(h, m.intermediate_size // t) + mm(m.intermediate_size // t, h)
    blk = block_time(m, local, gpu, eff, run.attention, compiled=run.compiled)
    elementwise = blk.forward - gemms - blk.attention_forward
    rerun = mm(h, m.num_key_value_heads * d // t) + mm(h // t, h) + mm(h, m.intermediate_size // t) + elementwise
    return layout.grad_accum * stage_blocks(m, layout) * rerun


def price(run: Run, layout: Layout | None = None):
    """The cost model's StepTime for `layout` (default: the published one) on `run`'s hardware and software
    (torchtitan's per-op checkpointing in place of bunsan's selective recompute where the run used it)."""
    layout = layout or run.layout
    gpu, intra, inter = parse_gpu_spec(run.gpu), interconnect(run.intra), interconnect(run.inter_node)
    sac = run.sac and layout.checkpointing == "selective"
    st = step_time(run.model, dataclasses.replace(layout, checkpointing="none") if sac else layout, gpu, intra,
                   inter, 8, attention=run.attention, compiled=run.compiled, overlap=run.overlap)
    return dataclasses.replace(st, recompute=sac_recompute(run, layout)) if sac else st


def search(run: Run, space: Space | None = None):
    """The planner's search of `run`'s question: its model, GPUs, batch, sequence and software (`space`)."""
    return plan(run.model, run.gpus, gpu=parse_gpu_spec(run.gpu), nodes=run.gpus // 8, seq_len=run.seq_len,
                global_batch=run.global_batch, interconnect_name=interconnect(run.intra),
                inter_node=interconnect(run.inter_node), precision=run.precision, attention=run.attention, keep=0,
                space=space or run.space, compiled=run.compiled, overlap=run.overlap)


def reproduce(run: Run, search_too: bool = True, space: Space | None = None) -> Reproduction:
    """The planner's price of `run`'s layout and its rank among `space` (default: the authors' options)."""
    own = price(run)
    predicted = per_gpu(run, own.total)
    if not (search_too and run.ranked):
        return Reproduction(run, predicted, None, 0, None, None, step=own)
    p = search(run, space)
    rank = next((i for i, c in enumerate(p.ranked, 1) if _same(c.layout, run.layout)), None)
    first = p.best
    first_predicted = per_gpu(run, first.step.total) if first else None
    peak = next((c.peak / 2 ** 30 for c in p.ranked if _same(c.layout, run.layout)), None)
    searched = p.pricing.price(run.layout).step.total if first else None
    return Reproduction(run, predicted, rank, len(p.ranked), first.layout if first else None, first_predicted, peak,
                        step=own, plan=p, searched_step=searched)


def layout_text(layout: Layout) -> str:
    """`layout` as `plan --explain` takes it."""
    return (f"dp={layout.dp},tp={layout.tp},pp={layout.pp},cp={layout.cp},zero={layout.zero},"
            f"mb={layout.micro_batch},recompute={layout.checkpointing},sp={layout.sequence_parallel},"
            f"schedule={layout.schedule},v={layout.virtual_stages},pipeline_gather={layout.pipeline_gather}")


def explain_published(run: Run, p=None):
    """`plan --explain` of `run`'s published layout against the planner's first choice (explain.py), from the
    search `p` (default: a new one)."""
    from bunsan.planner.explain import explain
    return explain(p or search(run), layout_text(run.layout))
