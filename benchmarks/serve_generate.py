"""transformers' own generation loop as a bench_serve.py contender (`--contenders transformers`): the same weights
as `LlamaForCausalLM`, `generate` on left-padded batches of as many requests as clients (static batching), the
first token timed by a logits processor, in this venv (bunsan's pinned transformers)."""

from __future__ import annotations

import time
from pathlib import Path

from bench_serve import SHAPE, BusyCores, _model, _p, _prompt


def transformers_rows(clients: list[int], per_client: int, max_tokens: int, tmp: Path, load: int,
                      dtype: str) -> list[list[str]]:
    """`generate` on static batches of as many requests as clients, `load` processes spinning beside it; `dtype`:
    torch's name (float32, bfloat16)."""
    import torch
    from transformers import LlamaForCausalLM, LogitsProcessor, LogitsProcessorList

    from bunsan.models.hf import save_llama
    from bunsan.training.data import load_tokenizer
    model = _model()
    save_llama(model.state_dict(), model.config, tmp)
    hf = LlamaForCausalLM.from_pretrained(str(tmp), torch_dtype=getattr(torch, dtype)).eval()
    tok = load_tokenizer(None)
    bias = torch.zeros(SHAPE["vocab_size"])
    bias[128:] = -100.0

    class FirstToken(LogitsProcessor):
        def __init__(self):
            self.at = None

        def __call__(self, input_ids, scores):
            self.at = self.at or time.perf_counter()
            return scores + bias
    with torch.no_grad():                                           # warm-up
        hf.generate(torch.tensor([tok.encode(_prompt(0))]), max_new_tokens=4, do_sample=False, pad_token_id=0)
    rows = []
    for c in clients:
        busy = BusyCores(load).__enter__()
        ttft, gaps, tokens, start = [], [], 0, time.perf_counter()
        for b in range(per_client):
            ids = [tok.encode(_prompt(b * c + k)) for k in range(c)]
            width = max(map(len, ids))
            batch = torch.tensor([[0] * (width - len(x)) + x for x in ids])
            mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
            first, t0 = FirstToken(), time.perf_counter()
            with torch.no_grad():
                out = hf.generate(batch, attention_mask=mask, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                  do_sample=False, logits_processor=LogitsProcessorList([first]), pad_token_id=0)
            ttft += [first.at - t0] * c
            gaps.append((time.perf_counter() - first.at) / max(1, out.shape[1] - width - 1))   # the batch's steps
            tokens += (out.shape[1] - width) * c
        wall = time.perf_counter() - start
        busy.__exit__()
        rows.append(["transformers generate, static batches", str(c), str(c * per_client), f"{tokens / wall:.1f}",
                     f"{_p(ttft, 0.5):.3f}", f"{_p(ttft, 0.99):.3f}", f"{_p(gaps, 0.5):.3f}",
                     f"{_p(gaps, 0.99):.3f}", f"batches of {c}"])
    return rows
