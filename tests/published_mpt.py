"""MosaicML's MPT training benchmarks (2023), priced by the planner: runs kept aside from every constant's fit.

Source: mosaicml/llm-foundry scripts/train/benchmarking/README.md at 061f2c7c ("MPT Training Benchmarks"),
the tables "H100 80GB BF16", "A100 80GB with 1600 Gbps node-node interconnect (RoCE)" and "A100 40GB with
1600 Gbps node-node interconnect (RoCE)": each row's model, sequence length, GPUs, micro-batch, gradient
accumulation, activation checkpointing and measured tokens per second per GPU ("Throughput (T/s/GPU)"). Every
run is Composer's FSDP FULL_SHARD (ZeRO-3) without tensor or pipeline parallelism, bf16 (amp_bf16, or "PURE"
bf16 where the table says so), eager (no torch.compile). The models' shapes are llm-foundry's
scripts/train/yamls/pretrain/mpt-*.yaml (d_model, n_heads, n_layers; vocabulary 50,368, tied embedding, a 4x
GELU MLP priced as the Llama block of the same parameters and FLOPs, like Megatron's GPT: published_runs.gpt),
attn_impl triton (FlashAttention's Triton port; priced as FlashAttention-2's measured fraction, hardware.py,
with bunsan's eager element-wise count: the port's own figure, attention "triton", with MPT's fused one is the
trial test_planner_published.py pins).
"1600 Gbps" per node of 8 is 200 Gb/s per GPU: priced as DGX A100's HDR links. The H100 rows are one node's 8
GPUs (no network crossed; the table gives none), SXM at 700 W. Chosen, before pricing any: every 1B-70B model's
2,048-token rows (A100 80GB: one node, 70B on 32 and 64 GPUs; A100 40GB: 128 GPUs; H100: one node), and the
A100 80GB 7B rows at 8K and 32K tokens (long context without context parallelism).

Priced, not ranked: bunsan's search space cannot leave tensor and pipeline parallelism out (Space has no such
switch), so a rank would set MPT's layouts against ones Composer could not run.
"""

from __future__ import annotations

from published_runs import Run, gpt

from bunsan.estimator.layout import Layout

SOURCE = "mosaicml/llm-foundry scripts/train/benchmarking/README.md @061f2c7c"
COMMIT = "061f2c7ce64e655100286584a7629e2a09f827ba"
# name -> (d_model, n_layers, n_heads) from the pretrain yamls
SHAPES = {"1B": (2048, 24, 16), "3B": (2560, 32, 20), "7B": (4096, 32, 32), "13B": (5120, 40, 40),
          "30B": (7168, 48, 56), "70B": (8192, 80, 64)}
GPUS = {"a100": "A100 80GB", "a100-40gb": "A100 40GB", "h100": "H100"}


def _mpt(size: str, seq: int, gpus: int, micro: int, accum: int, checkpointing: bool, measured: float,
         gpu: str = "a100") -> Run:
    hidden, layers, heads = SHAPES[size]
    layout = Layout(dp=gpus, zero=3, micro_batch=micro, grad_accum=accum, seq_len=seq, precision="bf16",
                    checkpointing="full" if checkpointing else "none")
    return Run(f"MPT {size} {seq // 1024}K, {gpus} {GPUS[gpu]}", SOURCE,
               gpt(hidden, layers, heads, vocab=50368, tp=1, seq=seq), gpus, gpus * micro * accum, layout, measured,
               "hdr", "bf16", gpu=gpu, ranked=False, intra="nvlink3" if gpu.startswith("a100") else "nvlink",
               attention="flash", compiled=False, count="tokens", group="MPT 2023 (held out)")


RUNS = (
    # A100 80GB: every model's 2,048-token row (one node; 70B on 32 and 64 GPUs), then 7B at 8K and 32K
    _mpt("1B", 2048, 8, 14, 4, False, 20513),
    _mpt("3B", 2048, 8, 10, 2, False, 10811),
    _mpt("7B", 2048, 8, 6, 2, False, 4641),
    _mpt("13B", 2048, 8, 2, 3, False, 2262),
    _mpt("30B", 2048, 8, 3, 21, True, 916),
    _mpt("70B", 2048, 32, 2, 16, True, 373),
    _mpt("70B", 2048, 64, 8, 4, True, 410),
    _mpt("7B", 8192, 8, 8, 2, True, 3206),
    _mpt("7B", 32768, 8, 2, 2, True, 1672),
    # A100 40GB: every model's 2,048-token row on 128 GPUs (16 nodes)
    _mpt("1B", 2048, 128, 10, 1, False, 18647, gpu="a100-40gb"),
    _mpt("3B", 2048, 128, 6, 1, False, 9538, gpu="a100-40gb"),
    _mpt("7B", 2048, 128, 18, 1, True, 3623, gpu="a100-40gb"),
    _mpt("13B", 2048, 128, 16, 1, True, 1972, gpu="a100-40gb"),
    _mpt("30B", 2048, 128, 6, 1, True, 865, gpu="a100-40gb"),
    _mpt("70B", 2048, 128, 4, 1, True, 376, gpu="a100-40gb"),
    # H100: every model's 2,048-token row on one node (3B has none)
    _mpt("1B", 2048, 8, 14, 1, False, 45455, gpu="h100"),
    _mpt("7B", 2048, 8, 6, 1, False, 10643, gpu="h100"),
    _mpt("13B", 2048, 8, 2, 1, False, 4792, gpu="h100"),
    _mpt("30B", 2048, 8, 3, 21, True, 2002, gpu="h100"),
)
