"""NVIDIA's DGX Cloud performance recipes (NeMo on DGX H100, 2024), priced by the planner: held out from every fit.

Source: NVIDIA/dgxc-benchmarking at 35a9aec ("v24.11.1"): each recipe's README "Expected Performance" table
(training step time in seconds at each GPU count, weak-scaled: the global batch grows with the GPUs) and the
same commit's configs (the yamls and configure.sh overrides) for everything else: Llama 3.1 8B and 70B (NeMo
24.09), Nemotron-4 15B and 340B and GPT-3 175B (NeMo 24.11), BF16 rows only (FP8 GEMMs are not priced). Every
column of those five tables is here, none chosen. Left out: Llama 3.1 405B, whose columns (32, 96, 192 ... GPUs)
cannot hold its stated layout (TP 8 x PP 9 x CP 2 is 144 GPUs a replica).

As the configs run them: bf16 with the distributed optimizer (distributed_fused_adam: ZeRO-1), Transformer
Engine's fused kernels (priced compiled) and the attention kernel each recipe's environment leaves Transformer
Engine: cuDNN's fused attention for Llama 3.1 (llama3.1/configure.sh: NVTE_FUSED_ATTN=1, NVTE_FLASH_ATTN=0) and
Nemotron-4 15B (nemotron/configure.sh: NVTE_FUSED_ATTN=1), priced at its H100 figure (hardware.FLASH_CUDNN_HOPPER);
FlashAttention-2 for Nemotron-4 340B (NVTE_FUSED_ATTN=0) and GPT-3 175B (nemo_megatron/launch.sh:
NVTE_FUSED_ATTN=0), sequence parallelism with TP, no recompute except the 340B's selective (Megatron's:
the attention core; bunsan's selective with recompute_ops ("attention",)), and the overlaps Megatron-Core's
README runs had (published_runs.MCORE_OVERLAPS: ub_tp_comm_overlap, overlap_grad_sync, overlap_param_sync; the
8B has no TP to overlap). Nemotron-4 has a two-matrix squared-ReLU MLP of width F: priced as the Llama block of
the same parameters and FLOPs (intermediate 2F/3), like Megatron's GPT (published_runs.gpt). Hardware: DGX H100
(H100 SXM 80GB at 700 W, NVLink, eight 400 Gb/s NDR links a node). Measured tokens/s per GPU = sequence x global
batch / step time / GPUs.
"""

from __future__ import annotations

from published_runs import LLAMA3_70B, LLAMA3_8B, MCORE_OVERLAPS, Run, gpt, llama

from bunsan.estimator.layout import Layout

SOURCE = "NVIDIA/dgxc-benchmarking READMEs and configs @35a9aec"
COMMIT = "35a9aecc8d5b17d99d80f52f38c75ade0dbab7ae"
NEMOTRON4_15B = llama(6144, 32, 48, 8, 2 * 24576 // 3, 256000)
NEMOTRON4_340B = llama(18432, 96, 96, 8, 2 * 73728 // 3, 256000)
GPT3_175B = gpt(12288, 96, 96, vocab=50688, tp=4)   # GPT-2's 50,257 tokens padded to a multiple of 128 x TP


def _recipe(name: str, model, seq: int, tp: int, pp: int, cp: int, vp: int, micro: int, accum: int,
            steps: dict, attention: str, selective: bool = False) -> tuple[Run, ...]:
    """One README table: `steps` is {GPUs: seconds per step}; data parallelism takes the GPUs the layout leaves,
    the global batch is dp x micro x accum (as the README's GBS columns)."""
    runs = []
    for gpus, seconds in steps.items():
        dp = gpus // (tp * pp * cp)
        layout = Layout(dp=dp, tp=tp, pp=pp, cp=cp, zero=1, micro_batch=micro, grad_accum=accum, seq_len=seq,
                        precision="bf16", checkpointing="selective" if selective else "none",
                        recompute_ops=("attention",), sequence_parallel=tp > 1,
                        schedule="interleaved" if vp > 1 else "1f1b", virtual_stages=vp)
        batch = dp * micro * accum
        runs.append(Run(f"NeMo {name}, {gpus} H100", SOURCE, model, gpus, batch, layout,
                        round(seq * batch / seconds / gpus, 1), "infiniband", "bf16", gpu="h100", ranked=False,
                        intra="nvlink", attention=attention, compiled=True, count="tokens",
                        group="NeMo on DGX H100 2024 (held out)",
                        overlap=MCORE_OVERLAPS if tp > 1 else ("grad_reduce", "param_gather"),
                        notes=(f"step {seconds} s at global batch {batch}",)))
    return tuple(runs)


RUNS = (
    _recipe("Llama 3.1 8B", LLAMA3_8B, 8192, 1, 1, 2, 1, 1, 32,
            {8: 12.91, 16: 13.00, 32: 13.05, 64: 13.08, 128: 13.10}, "cudnn")
    + _recipe("Llama 3.1 70B", LLAMA3_70B, 8192, 4, 4, 2, 5, 1, 64,
              {64: 14.72, 128: 14.73, 256: 14.8, 512: 14.89, 1024: 14.92, 2048: 14.98}, "cudnn")
    + _recipe("Nemotron-4 15B", NEMOTRON4_15B, 4096, 4, 1, 1, 1, 4, 4,
              {16: 2.83, 32: 2.86, 64: 2.86, 128: 2.89, 256: 2.88, 512: 2.92, 1024: 2.92, 2048: 2.96},
              "cudnn")
    + _recipe("Nemotron-4 340B", NEMOTRON4_340B, 4096, 8, 8, 1, 12, 1, 16,
              {128: 4.61, 256: 4.67, 512: 4.7, 1024: 4.73, 2048: 4.84}, "flash", selective=True)
    + _recipe("GPT-3 175B", GPT3_175B, 2048, 4, 8, 1, 12, 1, 64,
              {128: 8.91, 256: 8.95, 512: 9.09, 1024: 9.01, 2048: 9.02}, "flash")
)
