"""Published large training runs, as their authors report them, and the planner's view of each.

Shared by benchmarks/bench_planner.py (prints the table) and tests/test_planner_published.py (pins it).
Figures and where they come from:

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
the Llama block with the same parameters and FLOPs (intermediate 8h/3, rounded to the tensor-parallel
size) and tied embeddings. Megatron-LM 2021 and BLOOM used no flash attention: attention "materialized"; their
element-wise ops ran as Megatron's fused kernels (fused layer norm, bias + GeLU, scale + mask + softmax):
priced compiled.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from bunsan.estimator.hardware import gpu_spec, interconnect
from bunsan.estimator.layout import Layout
from bunsan.models.llama import LlamaConfig
from bunsan.planner.cost import step_time
from bunsan.planner.search import plan
from bunsan.planner.space import Space

# What the authors' software could run. Megatron-LM 2021: tensor, pipeline (1F1B, interleaved) and data
# parallelism, full recompute in every Table 1 and 2 run, no sequence parallelism (Korthikanti et al. 2022),
# no ZeRO. Megatron-DeepSpeed (BLOOM): the same plus ZeRO-1 (its pipeline engine runs no ZeRO-2/3).
MEGATRON_2021 = Space(zero=(0,), recompute=("full",), sequence_parallel=(False,), offload=("none",), cp=(1,))
MEGATRON_DEEPSPEED = Space(zero=(0, 1), recompute=("full",), sequence_parallel=(False,), offload=("none",), cp=(1,))


def gpt(hidden: int, layers: int, heads: int, vocab: int = 51200, tp: int = 8) -> LlamaConfig:
    inter = 8 * hidden // 3 // tp * tp
    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                       num_attention_heads=heads, max_position_embeddings=2048, tie_word_embeddings=True)


@dataclass(frozen=True)
class Run:
    name: str
    source: str
    model: LlamaConfig
    gpus: int
    global_batch: int
    layout: Layout                 # what the authors ran
    measured_tflops: float         # per GPU, the paper's count (recompute included)
    inter_node: str
    precision: str
    gpu: str = "a100"
    seq_len: int = 2048
    space: Space = MEGATRON_2021   # what the authors could have picked instead
    ranked: bool = True            # False: priced only (a layout nobody would pick, kept for its trend)
    notes: tuple = field(default=())


def _ptd(dp, tp, pp, mb, batch, zero=0) -> Layout:
    return Layout(dp=dp, tp=tp, pp=pp, zero=zero, micro_batch=mb, grad_accum=batch // (dp * mb), seq_len=2048,
                  precision="fp16", checkpointing=True)


GPT3 = gpt(12288, 96, 96)
BLOOM = gpt(14336, 70, 112, vocab=250880, tp=4)
T1, T2 = "Narayanan et al. 2021, Table 1", "Narayanan et al. 2021, Table 2"

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
               checkpointing=True), 150, "omnipath", "bf16", space=MEGATRON_DEEPSPEED),
    Run("GPT-3 175B ZeRO-3, 384 A100", T2, GPT3, 384, 1536, _ptd(384, 1, 1, 4, 1536, zero=3), 144, "hdr", "fp16",
        ranked=False),
    Run("GPT-3 175B ZeRO-3, 768 A100", T2, GPT3, 768, 1536, _ptd(768, 1, 1, 2, 1536, zero=3), 88, "hdr", "fp16",
        ranked=False, notes=("micro-batch 2: 1536 samples over 768 GPUs",)),
    Run("GPT-3 175B ZeRO-3, 1536 A100", T2, GPT3, 1536, 1536, _ptd(1536, 1, 1, 1, 1536, zero=3), 44, "hdr",
        "fp16", ranked=False, notes=("micro-batch 1: 1536 samples over 1536 GPUs",)),
)


def megatron_flops(model: LlamaConfig, batch: int, seq: int) -> float:
    """FLOPs per step as the Megatron-LM paper counts them (with the recomputed forward)."""
    b, s, l, h, v = batch, seq, model.num_hidden_layers, model.hidden_size, model.vocab_size
    return 96 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))


@dataclass
class Reproduction:
    run: Run
    predicted_tflops: float        # the planner's price of the published layout, the paper's count
    rank: int | None               # of the published layout among those that fit (1 = first choice)
    ranked: int                    # layouts that fit
    first: Layout | None
    first_tflops: float | None
    published_peak_gib: float | None = None

    @property
    def error(self) -> float:
        return self.predicted_tflops / self.run.measured_tflops - 1

    @property
    def behind_first(self) -> float | None:
        """How much slower the planner thinks the published layout is than its first choice."""
        return None if self.first_tflops is None else 1 - self.predicted_tflops / self.first_tflops


def _same(a: Layout, b: Layout) -> bool:
    keys = ("dp", "tp", "pp", "zero", "micro_batch", "checkpointing", "schedule", "virtual_stages",
            "sequence_parallel", "offload_optimizer", "offload_param", "offload_blocks")
    return all(getattr(a, k) == getattr(b, k) for k in keys)


def reproduce(run: Run, search: bool = True, space: Space | None = None) -> Reproduction:
    """The planner's price and rank of `run`'s layout among `space` (default: the authors' options)."""
    gpu, intra, inter = gpu_spec(run.gpu), interconnect("nvlink3"), interconnect(run.inter_node)
    flops = megatron_flops(run.model, run.global_batch, run.seq_len)
    own = step_time(run.model, run.layout, gpu, intra, inter, 8, attention="materialized", compiled=True)
    predicted = flops / own.total / run.gpus / 1e12
    if not (search and run.ranked):
        return Reproduction(run, predicted, None, 0, None, None)
    p = plan(run.model, run.gpus, gpu=gpu, nodes=run.gpus // 8, seq_len=run.seq_len,
             global_batch=run.global_batch, interconnect_name=intra, inter_node=inter, precision=run.precision,
             attention="materialized", keep=0, space=space or run.space, compiled=True)
    rank = next((i for i, c in enumerate(p.ranked, 1) if _same(c.layout, run.layout)), None)
    first = p.best
    first_tflops = flops / first.step.total / run.gpus / 1e12 if first else None
    peak = next((c.peak / 2 ** 30 for c in p.ranked if _same(c.layout, run.layout)), None)
    return Reproduction(run, predicted, rank, len(p.ranked), first.layout if first else None, first_tflops, peak)
