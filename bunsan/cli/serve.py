"""`bunsan serve`: load a checkpoint (bunsan train's output, or a Hugging Face Llama directory, optionally spread
over devices, CPU and disk) and serve OpenAI-style completions over HTTP with continuous batching."""

from __future__ import annotations

from pathlib import Path

from bunsan.cli.launch import relaunch, under_torchrun


def add_parser(sub) -> None:
    s = sub.add_parser("serve", help="serve completions over HTTP (OpenAI-style), continuous batching")
    s.add_argument("--checkpoint", required=True,
                   help="output dir of `bunsan train` (or its final/ folder), or a Hugging Face Llama directory")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--tokenizer", default=None, help="tokenizer.json (default: the checkpoint's, else bytes)")
    s.add_argument("--slots", type=int, default=8, help="requests decoded together (KV cache slots)")
    s.add_argument("--context", type=int, default=None,
                   help="tokens per request, prompt included (default: the model's max_position_embeddings)")
    s.add_argument("--max-tokens", type=int, default=1024, help="the most max_tokens one request may ask for")
    s.add_argument("--max-concurrent", type=int, default=64, help="requests running or waiting; beyond: 429")
    s.add_argument("--max-body-bytes", type=int, default=1 << 20)
    s.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel processes: rank 0 serves, every rank holds 1/tp of the heads and KV cache")
    s.add_argument("--timeout", type=float, default=30.0,
                   help="seconds a tensor-parallel collective may take before serving stops with an error")
    s.add_argument("--device-map", choices=("auto", "balanced", "sequential"),
                   help="spread a Hugging Face Llama directory over devices, CPU and disk")
    s.add_argument("--max-memory", help="budgets for --device-map, e.g. 0=20GiB,cpu=64GiB")
    s.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32",
                   help="the weights' and the KV cache's dtype (sampling is fp32 whatever it is)")


def load_model(args):
    """(model, tokenizer, name, context) for the server."""
    from bunsan.cli.generate import hf_tokenizer, parse_max_memory, torch_dtype, trained_model
    ckpt = Path(args.checkpoint)
    dtype = torch_dtype(args.dtype)
    trained = (ckpt / "final" / "model.safetensors").is_file() or (
        (ckpt / "model.safetensors").is_file() and "bunsan_config" in (ckpt / "config.json").read_text())
    if trained and not args.device_map:
        model, tokenizer = trained_model(ckpt, args.tokenizer, "serve", dtype)
    else:
        from bunsan.models.hf import read_config
        context = _context(args, read_config(ckpt))
        if args.device_map:
            from bunsan.inference import load
            model, _ = load(ckpt, args.device_map, parse_max_memory(args.max_memory), dtype=dtype, batch=args.slots,
                            max_seq=context)
        else:
            from bunsan.models.hf import load_llama
            model = load_llama(ckpt, dtype).eval()
        tokenizer = hf_tokenizer(ckpt, args.tokenizer, model.config.vocab_size)
    return model, tokenizer, ckpt.resolve().name, _context(args, model.config)


def _context(args, cfg) -> int:
    context = args.context or cfg.max_position_embeddings
    if not 2 <= context <= cfg.max_position_embeddings:
        raise ValueError(f"--context {context} must be in 2..{cfg.max_position_embeddings} (the model's "
                         "max_position_embeddings): a request's prompt and new tokens share it")
    return context


def cmd_serve(args) -> int:
    from bunsan.cli.generate import refuse_tp_with_device_map
    for flag in ("slots", "max_tokens", "max_concurrent", "max_body_bytes", "tp"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} {getattr(args, flag)} must be at least 1")
    refuse_tp_with_device_map(args)
    if args.tp > 1 and not under_torchrun():
        return relaunch(args, args.tp)
    import uvicorn

    from bunsan.serve import Batcher, Limits, SlotCache, build_app
    model, tokenizer, name, context = load_model(args)
    leader, kv_heads = None, None
    if args.tp > 1:
        from bunsan.inference.tp import split_over_ranks
        from bunsan.serve.tp import Leader, follow
        shard = split_over_ranks(model, args.tp, timeout_s=args.timeout)
        kv_heads = shard.kv_heads
        if shard.rank != 0:      # rank 0 samples; the others run each forward it announces
            follow(model, SlotCache(model, args.slots, context, kv_heads), shard.comm, shard.group, shard.device)
            return 0
        leader = Leader(shard.comm, shard.group, shard.device)
    batcher = Batcher(model, args.slots, context, kv_heads, leader)
    app = build_app(batcher, tokenizer, name, Limits(args.max_body_bytes, args.max_tokens, args.max_concurrent))
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning"))

    def fatal(message: str) -> None:        # a tensor-parallel rank is gone: answer errors, then stop
        print(f"bunsan serve: {message}; shutting down", flush=True)
        server.should_exit = True
    batcher.on_fatal = fatal
    print(f"bunsan serve: {name} on http://{args.host}:{args.port} ({args.slots} slots x {context} tokens"
          + (f", tensor parallel over {args.tp} processes" if args.tp > 1 else "") + "); POST /v1/completions, "
          "GET /health", flush=True)
    server.run()
    return 1 if batcher.fatal else 0
