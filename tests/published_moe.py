"""A published mixture-of-experts run, priced by the planner's cost model: NVIDIA's Grok-1 recipe on DGX H100.

Source: NVIDIA/dgxc-benchmarking at 85380ff ("v25.04.01"): grok1/README_314b.md (the layout table and the BF16
"Training step time" row, 8 to 2,048 H100) and grok1/cfg/grok1_314b.yaml: hidden 6144, 48 heads, 8 key/value
groups, 8 experts of width 32768, top-2, vocabulary 131,072 (Llama 3's tokenizer), sequence parallelism, the
alltoall token dispatcher with moe_expert_capacity_factor 1.0 padded to capacity, no grouped GEMM, the
distributed optimizer (ZeRO-1) with overlap_grad_sync and overlap_param_sync, Transformer Engine's fused
kernels (priced compiled) with NVTE_FUSED_ATTN=0 (FlashAttention-2). The rows under 512 GPUs are the recipe's
proxies with fewer layers (its "Layers" column). Global batch 1024 up to 512 GPUs, then 2048 and 4096 (the
README's own throughput row). Data parallelism takes the GPUs the layout leaves: gpus / (tp x pp x cp), the
README's "DP" column being the experts' data-parallel size. Megatron-Core folds EP over the dp x cp ranks with
the experts' tensor-parallel size that of attention, and its dispatcher sends each tensor-parallel rank's slice
of the rows, gathered inside the node: bunsan's engine runs that layout the same way. Held out from every fit.
"""

from __future__ import annotations

from bunsan.estimator.hardware import gpu_spec, interconnect, intra_link
from bunsan.estimator.layout import Layout
from bunsan.models.llama import LlamaConfig
from bunsan.planner.cost import StepTime, step_time

SOURCE = "NVIDIA/dgxc-benchmarking v25.04.01 (85380ff) grok1/README_314b.md, cfg/grok1_314b.yaml"
GROK1 = dict(vocab_size=131072, hidden_size=6144, intermediate_size=32768, num_attention_heads=48,
             num_key_value_heads=8, max_position_embeddings=32768,
             moe={"num_experts": 8, "top_k": 2, "expert_intermediate_size": 32768, "capacity_factor": 1.0})
# GPUs: (seq, layers, tp, pp, cp, ep, vp, global batch, measured seconds per step)
ROWS = {8: (4096, 2, 4, 1, 1, 2, 1, 1024, 24.00), 16: (4096, 4, 4, 1, 1, 4, 1, 1024, 21.71),
        32: (4096, 4, 4, 1, 1, 8, 1, 1024, 10.70), 64: (8192, 8, 4, 1, 2, 8, 1, 1024, 21.42),
        128: (8192, 16, 4, 2, 2, 8, 8, 1024, 20.73), 256: (8192, 32, 4, 4, 2, 8, 8, 1024, 20.83),
        512: (8192, 64, 4, 8, 2, 8, 8, 1024, 21.01), 1024: (8192, 64, 4, 8, 2, 8, 8, 2048, 21.20),
        2048: (8192, 64, 4, 8, 2, 8, 8, 4096, 21.29)}


def priced(gpus: int) -> tuple[Layout, StepTime, float]:
    """(the layout as bunsan writes it, the cost model's step, the measured seconds) of the `gpus` row."""
    seq, layers, tp, pp, cp, ep, vp, batch, measured = ROWS[gpus]
    dp = gpus // (tp * pp * cp)
    layout = Layout(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, zero=1, micro_batch=1, grad_accum=batch // dp, seq_len=seq,
                    precision="bf16", sequence_parallel=True, schedule="interleaved" if vp > 1 else "1f1b",
                    virtual_stages=vp)
    gpu = gpu_spec("h100")
    step = step_time(LlamaConfig(num_hidden_layers=layers, **GROK1), layout, gpu, intra_link(gpu),
                     interconnect("infiniband"), 8, compiled=True, overlap=("grad_reduce", "param_gather"))
    return layout, step, measured
