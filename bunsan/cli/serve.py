"""`bunsan serve`: load a checkpoint (bunsan train's output, or a Hugging Face causal LM directory, optionally
spread over devices, CPU and disk, or over tensor-parallel processes) and serve OpenAI- and Ollama-compatible
completions, chat and embeddings over HTTP with continuous batching over a paged KV cache."""

from __future__ import annotations

import os
from pathlib import Path

from bunsan.cli.launch import relaunch, under_torchrun

# sequences decoded together by default: past --slots requests wait (they are not refused) and a pool that
# runs short preempts, so this bounds one forward's rows, as vLLM's default --max-num-seqs does
AUTO_SLOTS = 256


def add_parser(sub) -> None:
    s = sub.add_parser("serve", help="serve completions over HTTP (OpenAI-style), continuous batching")
    s.add_argument("--checkpoint", required=True,
                   help="output dir of `bunsan train` (or its final/ folder), or a Hugging Face causal LM directory")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--tokenizer", default=None, help="tokenizer.json (default: the checkpoint's, else bytes)")
    s.add_argument("--slots", type=_slots, default="auto",
                   help="sequences decoded together (vLLM's --max-num-seqs), the paged KV cache's blocks shared "
                        f"among them; auto: {AUTO_SLOTS}, at most --max-concurrent")
    s.add_argument("--kv-cache-memory", default=None,
                   help="the paged KV cache's size, e.g. 4GiB (default: 30%% of the memory free where the cache "
                        "lives after the weights, at most --slots sequences of --context tokens)")
    s.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
    s.add_argument("--served-model-name", nargs="+", default=None,
                   help="the name(s) requests' `model` may give (default: the checkpoint folder's name)")
    s.add_argument("--chat-template", default=None,
                   help="a Jinja chat template file (default: the checkpoint's own, else ChatML)")
    s.add_argument("--no-prefix-reuse", action="store_true",
                   help="prefill every prompt whole (default: reuse the KV cache of a shared prefix)")
    s.add_argument("--shutdown-grace", type=float, default=5.0,
                   help="on SIGTERM, seconds running requests may finish before they are answered with an error")
    s.add_argument("--body-timeout", type=float, default=30.0, help="seconds a request's body may take to arrive")
    s.add_argument("--keep-alive-timeout", type=float, default=75.0,
                   help="seconds an idle keep-alive connection stays open (longer than clients keep theirs)")
    s.add_argument("--context", type=int, default=None,
                   help="tokens per request, prompt included (default: the model's max_position_embeddings)")
    s.add_argument("--max-tokens", type=int, default=1024, help="the most max_tokens one request may ask for")
    s.add_argument("--max-concurrent", type=int, default=1024,
                   help="sequences running or waiting for a place; beyond: 429")
    s.add_argument("--max-body-bytes", type=int, default=1 << 20)
    s.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel processes: rank 0 serves, every rank holds 1/tp of the heads and KV cache")
    s.add_argument("--timeout", type=float, default=30.0,
                   help="seconds a tensor-parallel collective may take before serving stops with an error")
    s.add_argument("--device-map", choices=("auto", "balanced", "sequential"),
                   help="spread the model over devices, CPU and disk (a Llama by bunsan's placement, others by "
                        "transformers')")
    s.add_argument("--max-memory", help="budgets for --device-map, e.g. 0=20GiB,cpu=64GiB")
    s.add_argument("--lora-modules", nargs="+", metavar="NAME=PATH",
                   help="LoRA adapters (peft folders, or bunsan train's RUN/adapter) served by name beside the base")
    s.add_argument("--max-loras", type=int, default=None,
                   help="adapters loaded at once (default: those of --lora-modules, plus 4 with --allow-runtime-lora)")
    s.add_argument("--max-lora-rank", type=int, default=None, help="the largest adapter rank (default: the largest "
                                                                     "given, at least 16)")
    s.add_argument("--allow-runtime-lora", action="store_true",
                   help="POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's) load and unload adapters")
    s.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32",
                   help="the weights' and the KV cache's dtype (sampling is fp32 whatever it is)")
    s.add_argument("--allowed-local-media-path", default=None, metavar="DIR",
                   help="a vision model's requests may name image files under DIR (default: data: URLs only)")
    s.add_argument("--threads", type=int, default=None,
                   help="torch's threads for a model served on the CPU (default: all cores but one, for HTTP)")
    s.add_argument("--cpu-bind", choices=("auto", "none"), default="auto",
                   help="auto: on the CPU, the model's process is bound to the cores its --threads use (the last "
                        "ones it may use), the HTTP process left the rest, as vLLM's CPU build binds its worker; "
                        "none: the scheduler places both (several servers on one host)")
    s.add_argument("--one-process", action="store_true",
                   help="run the HTTP server in the model's process (default: a process of its own, so that its "
                        "Python never stalls the model's steps)")


def _slots(text: str):
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"--slots {text!r} must be a whole number or auto") from None


def load_model(args):
    """(model, tokenizer, name, context) for the server: bunsan's Llama, or another transformers causal LM
    behind the serving forward (serve/transformers_model.py)."""
    from bunsan.checkpoint.adapter import adapter_dir
    from bunsan.checkpoint.final import final_dir, is_final
    from bunsan.cli.generate import hf_tokenizer, parse_max_memory, torch_dtype, trained_model
    from bunsan.models.hf import read_config
    from bunsan.serve.transformers_model import TransformersLM
    from bunsan.training.hf_model import is_other_architecture
    ckpt = Path(args.checkpoint)
    dtype = torch_dtype(args.dtype)
    trained = any(final_dir.is_dir() and is_final(final_dir) for final_dir in (ckpt / "final", ckpt)) or \
        adapter_dir(ckpt) is not None        # (a LoRA adapter: merged into its base, cli/generate.py)
    other = is_other_architecture(final_dir(ckpt) or ckpt)
    if args.device_map and other:            # transformers' own placement (Accelerate's)
        from bunsan.inference.transformers_placed import load_placed
        folder = final_dir(ckpt) or ckpt
        model = load_placed(folder, args.device_map, parse_max_memory(args.max_memory), dtype)
        tokenizer = hf_tokenizer(folder, args.tokenizer, model.config.vocab_size)
    elif (trained or other) and not args.device_map:
        model, tokenizer = trained_model(ckpt, args.tokenizer, "serve", dtype)
    else:
        context = _context(args, read_config(ckpt))
        if args.device_map:
            from bunsan.inference import load
            batch = args.slots if isinstance(args.slots, int) else min(AUTO_SLOTS, args.max_concurrent)
            model, _ = load(ckpt, args.device_map, parse_max_memory(args.max_memory), dtype=dtype, batch=batch,
                            max_seq=context)
        else:
            from bunsan.models.hf import load_llama
            model = load_llama(ckpt, dtype).eval()
        tokenizer = hf_tokenizer(ckpt, args.tokenizer, model.config.vocab_size)
    from bunsan.models import Llama
    if not isinstance(model, Llama):
        model = TransformersLM(model)
    return model, tokenizer, ckpt.resolve().name, _context(args, model.config)


def _context(args, cfg) -> int:
    context = args.context or cfg.max_position_embeddings
    if not 2 <= context <= cfg.max_position_embeddings:
        raise ValueError(f"--context {context} must be in 2..{cfg.max_position_embeddings} (the model's "
                         "max_position_embeddings): a request's prompt and new tokens share it")
    return context


def cache_size(args, model, context: int, kv_heads: int | None) -> tuple[int, int, str]:
    """(sequences decoded together, KV blocks in the pool, the line bunsan serve prints about them)."""
    import torch

    from bunsan.estimator.hardware import parse_bytes
    from bunsan.serve.paged import block_bytes, free_memory, input_device
    dtype = next(model.parameters()).dtype
    per_block = block_bytes(model.config, args.block_size, kv_heads, dtype)
    slots = min(AUTO_SLOTS, args.max_concurrent) if args.slots == "auto" else args.slots
    whole = 1 + slots * -(-context // args.block_size)          # every sequence at the full context
    if args.kv_cache_memory:
        budget, why = parse_bytes(args.kv_cache_memory), "--kv-cache-memory"
        blocks = budget // per_block
    else:
        free = free_memory(input_device(model))
        blocks = min(int(0.3 * free) // per_block, whole)
        why = f"the smaller of 30% of {free / 2**30:.1f} GiB free and {slots} sequences of {context} tokens"
    if blocks < 2 or (blocks - 1) * args.block_size < context:
        raise ValueError(f"a KV cache of {blocks} blocks of {args.block_size} tokens ({why}) does not hold one "
                         f"request of --context {context} tokens: give --kv-cache-memory at least "
                         f"{(1 + -(-context // args.block_size)) * per_block / 2**20:.1f}MiB, or lower --context")
    dtype_name = str(dtype).removeprefix("torch.")
    tokens = (blocks - 1) * args.block_size
    return slots, blocks, (f"KV cache {blocks - 1} blocks x {args.block_size} tokens = {tokens} tokens, "
                           f"{blocks * per_block / 2**30:.3f} GiB ({dtype_name}) on "
                           f"{torch.device(input_device(model))}: {why}; up to {slots} sequences at once")


def _agreed(shard, slots: int, blocks: int) -> tuple[int, int]:
    """Rank 0's sequence and block counts, on every rank (their caches must have the same blocks)."""
    import torch
    counts = torch.tensor([slots, blocks], dtype=torch.long, device=shard.device)
    shard.comm.broadcast(counts, 0, shard.group)
    return tuple(counts.tolist())


def vision_inputs(args, model, folder: Path):
    """(a vision-language model's media.VisionInputs, the line bunsan serve prints about images); (None, that
    line) for a text model or a folder without the processor's files."""
    if getattr(model, "composite", None) is None:
        if args.allowed_local_media_path:
            raise ValueError("--allowed-local-media-path: this model takes no images (not a vision-language model)")
        return None, None
    from bunsan.serve.media import ImageReader, VisionInputs
    if model.image_token_id is None:         # an audio-language model (Qwen2-Audio): its text is served
        if args.allowed_local_media_path:
            raise ValueError("--allowed-local-media-path: this model takes no images (its encoder reads audio)")
        return None, (f"images: off ({model.architecture} takes no images); audio: not served, an audio "
                      "content part is a 400")
    if not any((folder / f).is_file() for f in ("preprocessor_config.json", "processor_config.json")):
        return None, f"images: off ({folder} has no preprocessor_config.json for the model's processor)"
    vision = VisionInputs(folder, ImageReader(args.allowed_local_media_path), model.image_token_id)
    where = f"data: URLs, files under {args.allowed_local_media_path}" if args.allowed_local_media_path else \
        "data: URLs (files: --allowed-local-media-path)"
    return vision, f"images: {type(vision.processor).__name__}, {where}"


def serve_app(args, model, tokenizer, name: str, context: int, batcher):
    from bunsan.checkpoint.adapter import adapter_dir
    from bunsan.checkpoint.final import final_dir
    from bunsan.serve import ChatTemplate, Limits, build_app
    ckpt = Path(args.checkpoint)
    # the model's own folder (a training output's final/ or adapter/): its template and end-of-turn ids are there
    model_folder = final_dir(ckpt) or adapter_dir(ckpt) or ckpt
    folder = Path(args.tokenizer).parent if args.tokenizer and Path(args.tokenizer).is_file() else model_folder
    template = Path(args.chat_template).read_text() if args.chat_template else None
    chat = ChatTemplate(tokenizer, folder, template)
    limits = Limits(args.max_body_bytes, args.max_tokens, args.max_concurrent, args.body_timeout)
    aliases = tuple(args.served_model_name or ())
    vision, vision_line = vision_inputs(args, model, model_folder)
    return build_app(batcher, tokenizer, aliases[0] if aliases else name, limits, aliases=aliases,
                     template=chat, runtime_lora=args.allow_runtime_lora, vision=vision), chat.source, vision_line


def refuse_lora_with_tp(args) -> None:
    if args.tp > 1 and (args.lora_modules or args.allow_runtime_lora):
        raise ValueError("--lora-modules / --allow-runtime-lora with --tp: adapters are served in one process; "
                         "merge the adapter into the model (bunsan convert --merge-lora) to serve it split")


def lora_adapters(args, model):
    """The AdapterSet of --lora-modules / --allow-runtime-lora installed in `model` (serve/lora.py), or None."""
    from bunsan.serve.lora import AdapterSet, parse_lora_modules
    named = parse_lora_modules(args.lora_modules)
    if not named and not args.allow_runtime_lora:
        return None
    refuse_lora_with_tp(args)
    if args.max_loras is not None and args.max_loras < max(1, len(named)):
        raise ValueError(f"--max-loras {args.max_loras} is fewer than the {len(named)} adapters of --lora-modules")
    ranks = [_adapter_rank(path) for _, path in named]
    adapters = AdapterSet(model, args.max_loras or len(named) + 4 * args.allow_runtime_lora,
                          args.max_lora_rank or max(ranks + [16]))
    for name, path in named:
        adapters.add(name, path)
    return adapters


def _adapter_rank(path: str) -> int:
    from bunsan.checkpoint.adapter import adapter_dir, read_adapter
    folder = adapter_dir(path)
    if folder is None:
        raise ValueError(f"--lora-modules {path}: no adapter_config.json + adapter_model.safetensors there")
    return read_adapter(folder)[0]["r"]


def cmd_serve(args) -> int:
    from bunsan.cli.generate import refuse_tp_with_device_map
    for flag in ("slots", "max_tokens", "max_concurrent", "max_body_bytes", "tp", "block_size"):
        value = getattr(args, flag)
        if value != "auto" and value < 1:
            raise ValueError(f"--{flag.replace('_', '-')} {value} must be at least 1")
    refuse_tp_with_device_map(args)
    refuse_lora_with_tp(args)                # (before any process starts)
    if args.tp > 1 and not under_torchrun():
        return relaunch(args, args.tp)
    from bunsan.serve import Batcher, PagedCache
    from bunsan.serve.server import cpu_threads
    threads = cpu_threads(args.threads)
    http = None
    if not args.one_process and int(os.environ.get("RANK", "0")) == 0:   # (rank 0 serves HTTP under --tp)
        from bunsan.serve.engine import HttpProcess
        http = HttpProcess(http_server)
    try:
        return _serve(args, threads, http)
    finally:
        if http is not None and http.child.is_alive():     # (a failure before serving: the child leaves)
            http.conn.close()
            http.child.join(10)


def _serve(args, threads: int, http) -> int:
    from bunsan.serve import Batcher, PagedCache
    model, tokenizer, name, context = load_model(args)
    on_cpu = args.tp == 1 and all(p.device.type == "cpu" for p in model.parameters())
    bound = None
    if on_cpu:                        # (torchrun gives each tensor-parallel rank its own thread count)
        import torch
        torch.set_num_threads(threads)
        if http is not None and args.cpu_bind == "auto":    # (one process: the event loop shares its cores)
            from bunsan.serve.server import bind_model_cores
            bound = bind_model_cores(threads)
    packed = 0
    if on_cpu and not (args.lora_modules or args.allow_runtime_lora):    # (adapters wrap plain nn.Linear)
        from bunsan.serve.cpu_linear import pack_linears, packable
        if packable(model):
            packed = pack_linears(model, rows=min(64, args.slots if isinstance(args.slots, int) else 64))
    leader, kv_heads, shard = None, None, None
    if args.tp > 1:
        from bunsan.inference.tp import split_over_ranks
        shard = split_over_ranks(model, args.tp, timeout_s=args.timeout)
        kv_heads = shard.kv_heads
    slots, blocks, cache_line = cache_size(args, model, context, kv_heads)
    if shard is not None:
        from bunsan.serve.tp import Leader, follow
        slots, blocks = _agreed(shard, slots, blocks)
        if shard.rank != 0:      # rank 0 samples; the others run each forward it announces
            cache = PagedCache(model, blocks, args.block_size, kv_heads)
            cache.warm(model.config.num_attention_heads // model.config.num_key_value_heads)   # (as rank 0's)
            follow(model, cache, shard.comm, shard.group, shard.device)
            return 0
        leader = Leader(shard.comm, shard.group, shard.device)
    batcher = Batcher(model, slots, context, kv_heads, leader, prefix_reuse=not args.no_prefix_reuse,
                      num_blocks=blocks, block_size=args.block_size, adapters=lora_adapters(args, model))
    cfg = model.config            # (compiled before serving, where the cache is on the CPU: a request would wait)
    in_place = batcher.cache.warm(cfg.num_attention_heads // cfg.num_key_value_heads)
    banner = {"slots": slots, "cache_line": cache_line, "threads": threads if on_cpu else None, "packed": packed,
              "cores": bound, "in_place": in_place}
    if http is None:
        return http_server(None, batcher, args, tokenizer, name, context, banner)
    return http.serve(batcher, tokenizer, (args, tokenizer, name, context, banner))


def http_server(conn, batcher, args, tokenizer, name: str, context: int, banner: dict) -> int:
    """Serve HTTP until shut down: over `batcher` in this process (conn None), or, in the HTTP process of
    two (serve/engine.py), over the model's process at `conn` (`batcher`: its facts)."""
    from bunsan.serve.server import Server
    if conn is not None:
        from bunsan.serve.engine_client import EngineClient
        batcher = EngineClient(conn, batcher)
    app, template, vision_line = serve_app(args, batcher.model, tokenizer, name, context, batcher)
    server = Server(app, args.host, args.port, grace_s=args.shutdown_grace, keep_alive_s=args.keep_alive_timeout,
                    ignore_sigint=conn is not None)

    def fatal(message: str) -> None:        # a tensor-parallel rank (or the model's process) is gone
        server.should_exit = True
        try:
            print(f"bunsan serve: {message}; shutting down", flush=True)
        except OSError:                     # (nobody reads our output any more: shut down all the same)
            pass
    batcher.on_fatal = fatal
    served = app.state.service.served
    print(f"bunsan serve: {', '.join(served)} on http://{args.host}:{args.port} ({banner['slots']} sequences, "
          f"{context} tokens each" + (f", tensor parallel over {args.tp} processes" if args.tp > 1 else "") + ")\n"
          f"  {banner['cache_line']}\n  chat: {template}; prefix reuse {'off' if args.no_prefix_reuse else 'on'}"
          + (f"; {banner['threads']} CPU threads for the model" if banner["threads"] else "")
          + (f" (bound to cores {','.join(map(str, banner['cores']))})" if banner.get("cores") else "")
          + (f"; {banner['packed']} linear layers prepacked (oneDNN)" if banner["packed"] else "")
          + ("; large decoding batches read their KV blocks in place (compiled)" if banner.get("in_place") else "")
          + ("; the model in a process of its own" if conn is not None else "") + "\n"
          + (f"  {vision_line}\n" if vision_line else "") +
          "  POST /v1/completions /v1/chat/completions /v1/embeddings /api/generate /api/chat /api/embed /api/show;"
          " GET /v1/models /api/tags /api/ps /health /metrics",
          flush=True)
    server.run()
    return 1 if batcher.fatal else 0
