"""transformers' Llama-form models against bunsan's Llama of the same shape: one training step's forward and
backward, timed on this machine. `bunsan plan` prices a Llama-form transformers model's step (Qwen2, Mistral,
Gemma, Qwen3, a transformers Llama: estimator/shape.py LLAMA_FORM_BLOCKS) as bunsan's Llama of its shape; this is
where that assumption is checked (Qwen3's q/k norms are passes the price leaves out).

    python benchmarks/bench_hf_blocks.py [--hidden 512] [--layers 8] [--heads 8] [--head-dim 64] [--rows 8]
                                         [--seq 256] [--steps 5] [--markdown out.md]

Every model gets the same dimensions (vocabulary, hidden size, MLP width, layers, heads, key/value heads, head_dim:
hidden / heads unless --head-dim sets it apart, as Qwen3 0.6B's is), PyTorch SDPA attention, eager, and the same
token rows; the step is the forward, a cross-entropy over the logits in fp32 and the backward. On a GPU the models run
in bf16, on a CPU in fp32 with one thread. Each figure is the median of --steps timed steps after two warm-ups.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from bunsan.models.llama import Llama, LlamaConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))     # its sibling, also when scripts/gpu-check imports it
from bench_kernels import timed  # noqa: E402


def models(dims: dict) -> dict:
    """name -> a builder of that model with `dims` (the transformers ones only where transformers has the class)."""
    import transformers as t
    dims = {**dims, "head_dim": dims.get("head_dim") or dims["hidden_size"] // dims["num_attention_heads"]}
    builders = {"bunsan Llama": lambda: Llama(LlamaConfig(**dims))}
    for name, cls, cfg in (("transformers Llama", "LlamaForCausalLM", "LlamaConfig"),
                           ("transformers Qwen2", "Qwen2ForCausalLM", "Qwen2Config"),
                           ("transformers Mistral", "MistralForCausalLM", "MistralConfig"),
                           ("transformers Qwen3", "Qwen3ForCausalLM", "Qwen3Config"),
                           ("transformers Gemma", "GemmaForCausalLM", "GemmaConfig")):
        if hasattr(t, cls):
            config = getattr(t, cfg)(**dims, attn_implementation="sdpa")
            builders[name] = lambda cls=cls, config=config: getattr(t, cls)(config)
    return builders


def step_seconds(model: torch.nn.Module, rows: torch.Tensor, steps: int) -> float:
    """Median seconds of one forward + backward (bench_kernels.timed: CUDA events on a GPU) after two warm-ups."""
    vocab = model.config.vocab_size
    kwargs = {} if isinstance(model, Llama) else {"use_cache": False}      # (transformers': no KV cache in training)

    def step():
        out = model(rows, **kwargs)
        logits = out.logits if hasattr(out, "logits") else out
        torch.nn.functional.cross_entropy(logits.reshape(-1, vocab).float(), rows.reshape(-1)).backward()
    return timed(step, rows.device, reps=steps, warmup=2)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=None, help="key/value heads (default: --heads)")
    p.add_argument("--head-dim", type=int, default=None, help="width of a head (default: hidden / heads)")
    p.add_argument("--intermediate", type=int, default=None, help="MLP width (default: 8/3 x hidden, to 16)")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--markdown", help="append the table to this file")
    args = p.parse_args(argv)
    from bench_dp import markdown_section, print_section   # (siblings; scripts/gpu-check imports the rest)
    if (args.hidden % args.heads and not args.head_dim) or min(args.layers, args.rows, args.seq, args.steps) < 1:
        p.error(f"--hidden {args.hidden} must split into --heads {args.heads} (or give --head-dim); layers, rows, "
                "seq and steps >= 1")
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    if not cuda:
        torch.set_num_threads(1)
    dims = dict(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                num_attention_heads=args.heads, num_key_value_heads=args.kv_heads or args.heads,
                intermediate_size=args.intermediate or 8 * args.hidden // 3 // 16 * 16,
                max_position_embeddings=max(args.seq, 1024), head_dim=args.head_dim)
    torch.manual_seed(0)
    rows = torch.randint(0, args.vocab, (args.rows, args.seq), device=device)
    results = []
    for name, build in models(dims).items():
        with torch.device(device):
            model = build().to(dtype)
        seconds = step_seconds(model, rows, args.steps)
        results.append((name, sum(q.numel() for q in model.parameters()), seconds))
        print(f"{name:22} {seconds * 1e3:9.1f} ms", flush=True)
        del model
    base = results[0][2]
    table = [[name, f"{n / 1e6:.2f}M", f"{s * 1e3:.1f}", f"{s / base:.3f}"] for name, n, s in results]
    where = torch.cuda.get_device_name() + ", bf16" if cuda else "CPU, fp32, one thread"
    text = markdown_section("transformers' Llama-form models against bunsan's Llama of their shape", [
        f"{where}; hidden {args.hidden}, {args.layers} layers, {args.heads} heads ({dims['num_key_value_heads']} "
        f"key/value) of {args.head_dim or args.hidden // args.heads}, MLP {dims['intermediate_size']}, vocabulary "
        f"{args.vocab}; {args.rows} x {args.seq} tokens; "
        f"forward + backward, median of {args.steps} steps"],
        ["model", "parameters", "step ms", "x bunsan's Llama"], table)
    print_section(text, args.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
