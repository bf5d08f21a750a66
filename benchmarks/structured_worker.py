"""bench_structured.py's worker: one grammar engine (llguidance, xgrammar or outlines-core) over one
vocabulary's cases, in the engine's own venv; one JSON line for the setup, then one per case.

    python benchmarks/structured_worker.py ENGINE --cases CASES.json [--repeats 5] [--budget-s 20] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

from bench_structured import EOS      # (this script's folder is on sys.path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("worker", choices=["llguidance", "xgrammar", "outlines"])
    p.add_argument("--cases", type=Path, required=True)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--budget-s", type=float, default=20.0)
    p.add_argument("--threads", type=int, default=1)
    return worker(p.parse_args(argv))


def worker(a) -> int:
    """Runs in the engine's own venv: one JSON line for the setup, then one per case."""
    import gc
    spec = json.loads(a.cases.read_text())
    engine = {"llguidance": Llguidance, "xgrammar": Xgrammar, "outlines": Outlines}[a.worker](spec, a.threads)
    print(json.dumps({"engine": a.worker, "version": engine.version, "setup_ns": engine.setup_ns}), flush=True)
    for case in spec["cases"]:
        out = {"engine": a.worker, "case": case["name"], "compile_ns": [], "first_mask_ns": [], "mask_ns": [],
               "advance_ns": [], "request_ns": [], "warm_mask_ns": [], "steps": len(case["ids"]) + 1, "repeats": 0}
        try:
            start = time.perf_counter()
            while out["repeats"] < a.repeats and (out["repeats"] == 0 or time.perf_counter() - start < a.budget_s):
                gc.collect()
                gc.disable()
                try:
                    walk(engine, case, spec["eos"], out)
                finally:
                    gc.enable()
                out["repeats"] += 1
        except Exception as e:          # noqa: BLE001  (an engine that cannot take a case: a row saying why)
            out = {"engine": a.worker, "case": case["name"], "error": f"{type(e).__name__}: {str(e)[:140]}"}
        print(json.dumps(out), flush=True)
    return 0


def walk(engine, case: dict, eos: int, out: dict) -> None:
    """Compile, then mask and take each token of the case's valid output; the end token must be allowed last.
    Then the same matcher reset and walked again: its masks "warm" (what a cache of compiled grammars gives)."""
    clock = time.perf_counter_ns
    t0 = clock()
    m = engine.compile(case["name"], case["grammar"])
    out["compile_ns"].append(clock() - t0)
    masks, advances = len(out["mask_ns"]), len(out["advance_ns"])
    _pass(engine, m, case, eos, out, "mask_ns")
    out["request_ns"].append(out["compile_ns"][-1] + sum(out["mask_ns"][masks:]) + sum(out["advance_ns"][advances:]))
    out["first_mask_ns"].append(out["mask_ns"][masks])
    engine.reset(m)
    _pass(engine, m, case, eos, out, "warm_mask_ns")


def _pass(engine, m, case: dict, eos: int, out: dict, into: str) -> None:
    clock, ids = time.perf_counter_ns, case["ids"]
    for i in range(len(ids) + 1):
        t0 = clock()
        engine.mask(m)
        out[into].append(clock() - t0)
        want = ids[i] if i < len(ids) else eos
        if not engine.allowed(want):
            raise RuntimeError(f"step {i}: token {want} not in the mask ({case['text'][:40]!r})")
        if i < len(ids):
            t0 = clock()
            ok = engine.advance(m, ids[i])
            if into == "mask_ns":
                out["advance_ns"].append(clock() - t0)
            if not ok:
                raise RuntimeError(f"step {i}: token {ids[i]} refused")


class _Bitmask:
    def allowed(self, token: int) -> bool:
        return bool((int(self.bits[0, token // 32]) >> (token % 32)) & 1)


class Llguidance(_Bitmask):
    """As bunsan serve asks it: structured.grammar_request, grammar_tokenizer and an LLMatcher."""

    def __init__(self, spec: dict, threads: int):
        import llguidance
        import llguidance.torch

        from bunsan.serve import structured
        from bunsan.training.tokenizer import ByteTokenizer, HFTokenizer
        self.version, self.structured, self.llg = llguidance._lib.get_version(), structured, llguidance
        tok = ByteTokenizer() if spec["vocab"] == "byte" else HFTokenizer(spec["vocab"])
        t0 = time.perf_counter_ns()
        if spec["vocab"] == "byte":
            self.lltok = structured.grammar_tokenizer(tok, 256, [])
        else:
            self.lltok = structured.grammar_tokenizer(tok, spec["size"], [spec["eos"]])
        self.setup_ns = time.perf_counter_ns() - t0
        self.bits = llguidance.torch.allocate_token_bitmask(1, self.lltok.vocab_size)
        self.fill = llguidance.torch.fill_next_token_bitmask

    def compile(self, kind: str, grammar):
        ask = {"json_schema": lambda: ({"type": "json_schema", "json_schema": {"schema": grammar}}, None),
               "json_object": lambda: ({"type": "json_object"}, None), "regex": lambda: (None, {"regex": grammar}),
               "choice": lambda: (None, {"choice": grammar})}[kind]()
        matcher = self.llg.LLMatcher(self.lltok, self.structured.grammar_request(*ask, {}))
        if matcher.is_error():
            raise RuntimeError(matcher.get_error())
        return matcher

    def mask(self, matcher) -> None:
        self.fill(matcher, self.bits)

    def advance(self, matcher, token: int) -> bool:
        return matcher.consume_token(token)

    def reset(self, matcher) -> None:
        matcher.reset()


class Xgrammar(_Bitmask):
    """As vLLM's xgrammar back end asks it."""

    def __init__(self, spec: dict, threads: int):
        from importlib.metadata import version

        import xgrammar as xgr
        self.xgr, self.version = xgr, version("xgrammar")
        if spec["vocab"] == "byte":
            t0 = time.perf_counter_ns()
            info = xgr.TokenizerInfo([bytes([i]) for i in range(256)] + [b"<end>"], xgr.VocabType.RAW,
                                     vocab_size=257, stop_token_ids=[256])
        else:
            from transformers import PreTrainedTokenizerFast
            hf = PreTrainedTokenizerFast(tokenizer_file=spec["vocab"], eos_token=EOS)
            t0 = time.perf_counter_ns()
            info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=spec["size"], stop_token_ids=[spec["eos"]])
        self.compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
        self.setup_ns = time.perf_counter_ns() - t0
        self.bits = xgr.allocate_token_bitmask(1, info.vocab_size)

    def compile(self, kind: str, grammar):
        c = self.compiler
        if kind == "json_schema":
            compiled = c.compile_json_schema(json.dumps(grammar), any_whitespace=False, separators=(", ", ": "))
        elif kind == "json_object":
            compiled = c.compile_builtin_json_grammar()
        elif kind == "regex":
            compiled = c.compile_regex(grammar)
        else:
            compiled = c.compile_grammar("root ::= " + " | ".join(json.dumps(s) for s in grammar))
        return self.xgr.GrammarMatcher(compiled)

    def mask(self, matcher) -> None:
        matcher.fill_next_token_bitmask(self.bits)

    def advance(self, matcher, token: int) -> bool:
        return matcher.accept_token(token)

    def reset(self, matcher) -> None:
        matcher.reset()


class Outlines(_Bitmask):
    """As vLLM's outlines back end asked it: a regex (from the schema), an Index over the vocabulary, a Guide."""

    def __init__(self, spec: dict, threads: int):
        from importlib.metadata import version

        import outlines_core
        import torch
        self.oc, self.version = outlines_core, version("outlines_core")
        eos = spec["eos"]
        if spec["vocab"] == "byte":
            tokens = {bytes([i]): [i] for i in range(256)}
        else:
            decode = {c: b for b, c in _bytes_to_unicode().items()}
            vocab = json.loads(Path(spec["vocab"]).read_text())["model"]["vocab"]
            tokens = {bytes(decode[c] for c in s): [i] for s, i in vocab.items() if i != eos}
        t0 = time.perf_counter_ns()
        self.vocabulary = outlines_core.Vocabulary(eos, tokens)
        self.setup_ns = time.perf_counter_ns() - t0
        self.bits = torch.zeros(1, (spec["size"] + 31) // 32, dtype=torch.int32)

    def compile(self, kind: str, grammar):
        from outlines_core.json_schema import build_regex_from_schema
        if kind == "json_schema":
            rx = build_regex_from_schema(json.dumps(grammar), r"[ ]?")
        elif kind == "json_object":
            rx = build_regex_from_schema(json.dumps({"type": "object"}), r"[ ]?")
        elif kind == "regex":
            rx = grammar
        else:
            rx = "|".join(re.escape(s) for s in grammar)
        return self.oc.Guide(self.oc.Index(rx, self.vocabulary))

    def mask(self, guide) -> None:
        guide.write_mask_into(self.bits.data_ptr(), self.bits.numel(), 4)

    def advance(self, guide, token: int) -> bool:
        guide.advance(token, return_tokens=False)
        return True

    def reset(self, guide) -> None:
        guide.reset()


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte as the character a byte-level BPE vocabulary spells it with."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


if __name__ == "__main__":
    sys.exit(main())
