"""Meta's Llama 3 405B pre-training (2024), priced by the planner: runs kept aside from every constant's fit.

Source: Dubey et al. 2024, "The Llama 3 Herd of Models" (arXiv:2407.21783), Table 4 ("scaling configurations and
MFU for each stage of Llama 3 405B pre-training"), as Pavan Balaji's SC'24 talk showed it and
glennklockwood.com/garden/llama-3.1 transcribes it: GPUs, TP, CP, PP, tokens per batch (16M) and TFLOP/s per GPU
(430, 400, 380). Not taken from a transcription: DP, which is GPUs / (TP x CP x PP) (64, 128 and 8; the
transcriptions of the long-context row disagree, 4 or 8, and 8 x 16 x 16 x 4 is 8,192 GPUs, not the row's 16,384),
and the batch per data-parallel rank, tokens per batch / (DP x sequence) (32, 16, 16). Sequence 8,192 in the
initial pre-training stage and 131,072 in long-context pre-training (the paper's section 3.4). Hardware (section
3.3.1): H100 80GB HBM3 SXM at 700 W, eight per Grand Teton server on NVLink, 400 Gb/s RoCE per GPU (priced as NDR
InfiniBand's 400 Gb/s per GPU), 126 layers, hidden 16,384, GQA 128/8, intermediate 53,248, vocabulary 128,256.

Assumed, each a note on its run:
- the FLOP count of "TFLOPs/GPU": PaLM's 6N + 12·L·h·s per token (N without the input embedding; causal
  attention counted whole), as torchtitan's get_num_flop_per_token counts; the paper does not spell it out.
- micro-batch 1; no activation recompute (the paper trains 8K sequences without activation checkpointing; the 128K
  row is assumed the same: with full recompute it would price 24% slow); TP with sequence parallelism (Megatron's,
  which the paper cites), fused element-wise kernels (priced compiled; priced eager the rows are 2-12% slow),
  flash attention (FlashAttention-2's measured H100 fraction).
- the sharding (section 3.3.2): parameters, gradients and optimizer states sharded over data parallelism,
  parameters gathered once a step and not resharded between micro-batches: bunsan's ZeRO-3 with its
  stage3_pipeline_gather "schedule" (layout pipeline_gather="schedule").
- the interleaved schedule's virtual stages (not published; the paper says the schedule is interleaved and
  tuned): 126 layers over 16 stages leave 8 a stage, Meta's balance taking one from the first and the last,
  so v is 1, 2 or 4; priced at v = 4, the planner's cheapest of the three for every row
  (tests/test_planner_published.py checks that it is). At v = 2 the rows price 11-21% slow, at v = 1 25-39%.

Priced, not ranked: bunsan's memory estimate of its own engine running these layouts is over 80 GB (99.6, 108 and
224 GiB at v = 4; 80.8, 80.3 and 213 at v = 1): its interleaved schedule holds more micro-batches in flight on the
first stage than 1F1B, its context-parallel attention saves K and V repeated to every head, and it does not free
each stage's inputs and outputs early as Meta's engine does (section 3.3.2). A search would rank them after every
layout that fits: a statement about bunsan's engine, not Meta's.
"""

from __future__ import annotations

from published_runs import LLAMA3_405B, Run

from bunsan.estimator.layout import Layout

SOURCE = "Dubey et al. 2024 (arXiv:2407.21783) Table 4, via Balaji SC'24"
TOKENS_PER_BATCH = 16 * 2 ** 20      # "16M": 64 x 32 x 8,192 = 16,777,216
PP, TP, VIRTUAL_STAGES = 16, 8, 4
NOTES = ("DP = GPUs / (TP x CP x PP); batch per DP rank = 16M tokens / (DP x sequence)",
         "PaLM's FLOP count (6N + 12 L h s) assumed", "micro-batch 1, no recompute, SP, fused kernels assumed",
         "FSDP under PP as ZeRO-3 gathered once a step", f"virtual stages not published: {VIRTUAL_STAGES} assumed")


def llama3_run(gpus: int, cp: int, seq: int, measured: float, virtual_stages: int = VIRTUAL_STAGES) -> Run:
    dp = gpus // (TP * cp * PP)
    per_dp = TOKENS_PER_BATCH // (dp * seq)
    layout = Layout(dp=dp, tp=TP, pp=PP, cp=cp, zero=3, pipeline_gather="schedule", micro_batch=1,
                    grad_accum=per_dp, seq_len=seq, precision="bf16", checkpointing="none", sequence_parallel=True,
                    schedule="interleaved" if virtual_stages > 1 else "1f1b", virtual_stages=virtual_stages)
    context = f" CP{cp} {seq // 1024}K" if cp > 1 else ""
    return Run(f"Llama 3 405B{context}, {gpus} H100", SOURCE, LLAMA3_405B, gpus, dp * per_dp, layout, measured,
               "infiniband", "bf16", gpu="h100", ranked=False, intra="nvlink", attention="flash", compiled=True,
               count="palm", group="Llama 3 405B 2024 (held out)", notes=NOTES)


RUNS = (
    llama3_run(8192, 1, 8192, 430),
    llama3_run(16384, 1, 8192, 400),
    llama3_run(16384, 16, 131072, 380),
)
