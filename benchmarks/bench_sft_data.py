"""Fine-tuning data on CPU: bunsan's chat rendering with prompt masking (training/examples.py) against
`datasets.map` with the same tokenizer and chat template, one and two worker processes.

The tokenizer is a byte-level BPE trained here on Python's standard library (no download); the records are
two-turn conversations cut from the same source. bunsan (data.tokenize_workers 1 and 2) renders each conversation through the template three
times per assistant turn (to find the turns' text) and tokenizes once with offsets; `datasets.map` runs
`apply_chat_template(..., tokenize=True)` only, without masking, so it does less work per record.

    python benchmarks/bench_sft_data.py [--records 4000] [--markdown PATH]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def make_tokenizer(folder: Path, corpus: list[str]) -> None:
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    t.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=8000, special_tokens=["<|im_start|>",
                                                      "<|im_end|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=t, eos_token="<|im_end|>",
                                                additional_special_tokens=["<|im_start|>"])
    fast.chat_template = CHATML
    fast.save_pretrained(folder)


def records(n: int) -> list[dict]:
    from bunsan.training.data import default_corpus_files
    text = "".join(f.read_text(errors="replace") for f in default_corpus_files()[:200])
    out, step = [], max(1, (len(text) - 2000) // n)
    for i in range(n):
        s = text[i * step:i * step + 1200]
        out.append({"messages": [{"role": "user", "content": s[:400]}, {"role": "assistant", "content": s[400:]}]})
    return out


def bench_bunsan(folder: Path, recs: list[dict], workers: int) -> tuple[float, int]:
    from bunsan.training.example_batches import rendered
    from bunsan.training.examples import Renderer
    from bunsan.training.tokenizer import load_tokenizer
    r = Renderer("chat", load_tokenizer(folder), folder, {}, False)
    t0 = time.perf_counter()
    n = sum(len(ids) for ids, _ in rendered([("bench", rec) for rec in recs], r, workers))
    return time.perf_counter() - t0, n


def bench_datasets(folder: Path, recs: list[dict], workers: int) -> tuple[float, int]:
    import datasets
    import transformers
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    ds = datasets.Dataset.from_list(recs)
    t0 = time.perf_counter()
    def ids(m):
        out = tok.apply_chat_template(m, tokenize=True)
        return out["input_ids"] if hasattr(out, "keys") else out     # (transformers 5 returns a dict)
    out = ds.map(lambda b: {"ids": [ids(m) for m in b["messages"]]},
                 batched=True, num_proc=workers if workers > 1 else None, remove_columns=["messages"],
                 load_from_cache_file=False)
    return time.perf_counter() - t0, sum(len(x) for x in out["ids"])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--records", type=int, default=4000)
    p.add_argument("--markdown", metavar="PATH")
    a = p.parse_args(argv)
    recs = records(a.records)
    with tempfile.TemporaryDirectory() as d:
        folder = Path(d)
        make_tokenizer(folder, [m["content"] for r in recs[:2000] for m in r["messages"]])
        rows = [(f"bunsan (masked), {w} process(es)", *bench_bunsan(folder, recs, w)) for w in (1, 2)]
        for w in (1, 2):
            rows.append((f"datasets.map (unmasked), {w} process(es)", *bench_datasets(folder, recs, w)))
    from bench_dp import markdown_section, print_section
    text = markdown_section(f"Fine-tuning data: chat rendering, {a.records} conversations", [],
                            ["contender", "seconds", "tokens", "tokens/s"],
                            [[name, f"{s:.2f}", f"{n:,}", f"{n / s:,.0f}"] for name, s, n in rows])
    print_section(text, a.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
