"""The command lines of `bunsan estimate` and `bunsan plan`: their flags, and the config keys the estimate's
flags set."""

from __future__ import annotations

# Flags of `bunsan estimate` that map onto config keys (the rest of the layout comes from --config).
ESTIMATE_FLAGS = {
    "zero": ("zero_optimization.stage", int), "tp": ("tensor_parallel.size", int), "pp": ("pipeline.stages", int),
    "cp": ("context_parallel.size", int), "schedule": ("pipeline.schedule", str), "virtual_stages": ("pipeline.virtual_stages", int),
    "micro_batch": ("train_micro_batch_size_per_gpu", int), "grad_accum": ("gradient_accumulation_steps", int),
    "seq_len": ("data.seq_len", int), "optimizer": ("optimizer.type", str),
    "offload_optimizer": ("zero_optimization.offload_optimizer.device", str),
    "offload_param": ("zero_optimization.offload_param.device", str),
    "recompute": ("activation_checkpointing.mode", str), "offload_blocks": ("activation_checkpointing.offload_blocks", str),
}
ESTIMATE_SWITCHES = {"bf16": "bf16.enabled", "fp16": "fp16.enabled", "checkpointing": "activation_checkpointing.enabled",
                     "sp": "tensor_parallel.sequence_parallel"}


GPUS_PER_NODE = 8          # what --nodes defaults to: a DGX/HGX server
MOST_GPUS_PER_NODE = 16    # no server holds more (DGX-2, HGX-2); more per node is a typo or a missing --nodes


def add_parsers(sub) -> None:
    e = sub.add_parser("estimate", help="memory per GPU and per host of a model under a layout")
    e.add_argument("--model", required=True, help="preset (tiny, small, 135m, 1b, llama3-8b, llama3-70b, "
                   "llama3-405b, 7b, 13b, 70b), a Hugging Face config.json or model directory, or a parameter count "
                   "(7.5B: model states only)")
    e.add_argument("--config", help="bunsan/DeepSpeed config file for the layout (default: bunsan's defaults)")
    e.add_argument("--gpus", type=int, help="GPUs in all (default: tp x pp x cp of the config)")
    e.add_argument("--nodes", type=int, help=f"nodes the GPUs are on (default: {GPUS_PER_NODE} GPUs per node)")
    e.add_argument("--gpu-memory", help="memory per GPU, e.g. 80GB or 24GiB (default: the --gpu's)")
    e.add_argument("--gpu", default=None, help="GPU model for its memory (h100, a100, l40s, ...)")
    e.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: price a CPU run (gloo)")
    for name, (key, typ) in ESTIMATE_FLAGS.items():
        e.add_argument("--" + name.replace("_", "-"), dest=name, type=typ, help=f"sets {key}")
    for flag, key in ESTIMATE_SWITCHES.items():
        e.add_argument("--" + flag, action="store_true", help=f"sets {key}")
    e.add_argument("--margin", type=float, default=None, help="fraction of GPU memory kept free (default: the "
                   "estimate's measured error decides, as in `bunsan plan`)")
    e.add_argument("--padding-mask", action="store_true", help="the batches carry an attention_mask with padding "
                   "(a script's; bunsan train's rows have none): a transformers model's blocks keep more")
    e.add_argument("--json", action="store_true", help="print the estimate as JSON")

    p = sub.add_parser("plan", help="layouts that fit a model on given GPUs, ranked by estimated step time")
    p.add_argument("--model", required=True, help="preset, Hugging Face config.json or model directory")
    p.add_argument("--gpus", type=int, required=True, help="GPUs in all")
    p.add_argument("--nodes", type=int, help=f"nodes the GPUs are on (default: {GPUS_PER_NODE} GPUs per node)")
    p.add_argument("--gpu", default="h100", help="GPU model (h100, h100-pcie, h200, a100, a100-pcie, a100-40gb, l40s, "
                   "a10, v100, rtx4090)")
    p.add_argument("--gpu-spec", help="measured or custom GPU figures: NAME[,bf16=312T][,fp16=..][,fp32=..]"
                   "[,memory=80GiB][,hbm=2TB][,form=SXM|PCIe][,power=400W][,sms=108] (a known NAME or custom; "
                   "replaces --gpu)")
    p.add_argument("--gpu-memory", help="memory per GPU (default: the --gpu's), e.g. 80GB")
    p.add_argument("--host-memory", help="host memory per node, to rule out offload that cannot fit, e.g. 1TB")
    p.add_argument("--seq-len", type=int, help="tokens per sample (default: min(model max, 4096))")
    p.add_argument("--global-batch", type=int, help="samples per optimizer step (default: max(gpus, 8))")
    p.add_argument("--interconnect", help="link inside a node: nvlink, nvlink3, pcie (default: the --gpu's)")
    p.add_argument("--inter-node", default="infiniband", help="link between nodes, per GPU: infiniband (NDR), "
                   "hdr, omnipath, ethernet")
    p.add_argument("--link-bandwidth", action="append", metavar="intra|inter=RATE", default=[],
                   help="measured bandwidth per GPU, one direction, e.g. inter=6.25GB/s (repeatable)")
    p.add_argument("--link-latency", action="append", metavar="intra|inter=SECONDS", default=[],
                   help="per-step latency of a link, e.g. inter=1e-5 (repeatable)")
    p.add_argument("--compile", action="store_true", help="price torch.compile's fused element-wise ops (and write "
                   "train.compile into --output's config); default: eager PyTorch, each op a pass over memory")
    p.add_argument("--attention", choices=("flash", "cudnn", "triton", "materialized"), default="flash",
                   help="the attention kernel priced: flash (FlashAttention-2, PyTorch SDPA's: bunsan's), cudnn "
                   "(cuDNN's fused kernel, Transformer Engine's on Hopper), triton (FlashAttention's Triton port, "
                   "llm-foundry's attn_impl triton; A100 only), materialized (the scores written out)")
    p.add_argument("--zero-stages", help="ZeRO stages to search, e.g. 0,1 (default 0,1,2,3)")
    p.add_argument("--recompute", help="recompute modes to search, e.g. full (default none,full,selective)")
    p.add_argument("--no-sp", action="store_true", help="leave sequence parallelism out of the search")
    p.add_argument("--no-activation-offload", action="store_true",
                   help="leave out sending blocks' activations to host memory (tried where a layout does not fit)")
    p.add_argument("--cp-sizes", help="context-parallel sizes to search, e.g. 1,2,4,8,16 (default: powers of two to 8, "
                        "and past 8 while each rank keeps 8192 of a row's tokens)")
    p.add_argument("--ep-sizes", help="expert-parallel sizes to search for a MoE model, e.g. 1,2,4,8 (default: "
                        "every one dividing both the dp x cp ranks and the experts)")
    p.add_argument("--constants", action="store_true", help="also print the cost model's constants and sources")
    p.add_argument("--precision", choices=("bf16", "fp16", "fp32"),
                   help="search this precision only (default: every one the GPU runs, fp32 included)")
    p.add_argument("--tokens", type=float, help="training tokens, for the time-to-train column (e.g. 1e12)")
    p.add_argument("--efficiency", type=float, help="fraction of the tensor-core peak a large GEMM reaches "
                   "(default 0.8: planner/constants.py)")
    p.add_argument("--margin", type=float, default=None,
                   help="fraction of GPU memory kept free (default: the estimate's measured error decides)")
    p.add_argument("--top", type=int, default=None, help="layouts to show (default 8; with --json every ranked "
                   "layout); 0: all")
    p.add_argument("--output", help="write the best layout's config here (JSON) and print its launch line per node")
    p.add_argument("--json", action="store_true",
                   help="print the search as JSON: every ranked layout (unless --top caps it) with its priced terms")
    p.add_argument("--kernels", metavar="FILE",
                   help="kernels measured on this GPU (benchmarks/bench_kernels.py's JSON or scripts/gpu-check's "
                        "gpu-check.json): GEMMs priced by shape, flash attention by its own curve")
    p.add_argument("--calibrate", metavar="FILE",
                   help="JSON list of measured runs ({\"layout\": \"tp=8,pp=2\", \"step_s\": 1.4} or tokens_per_s) "
                        "of this model, GPUs, sequence and batch: fit the compute and link scales, then plan")
    p.add_argument("--explain", metavar="LAYOUT",
                   help="price this layout as the first choice was and compare them term by term, e.g. "
                        "tp=8,pp=4,zero=1,mb=1,recompute=selective,sp=true (the rest from the first choice)")
