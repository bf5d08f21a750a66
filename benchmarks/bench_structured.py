"""Structured outputs' grammar engines side by side (issue #39): llguidance (the pinned one bunsan serves with,
through bunsan's own structured.py), xgrammar and outlines-core (from a venv of their own), on the same
vocabularies, grammars and token paths: grammar compile time and the per-token mask time over a whole valid
output.

    python benchmarks/bench_structured.py [--vocabs byte,32000,100000] [--engines llguidance,xgrammar,outlines]
                                          [--repeats 5] [--threads 1] [--markdown benchmarks/RESULTS.md]

Vocabularies: bunsan's byte tokenizer (256 tokens and an end token) and byte-level BPE tokenizer.json files
trained here with the `tokenizers` library on Python's standard-library sources (no downloads), cached under
--work. Cases: (i) a realistic JSON schema (nested object, arrays of objects, enums, numbers with bounds,
string patterns and lengths), (ii) json_object (any JSON object), (iii) a regex (a log line), (iv) a choice of
40 strings. For each, one valid output is tokenized once (the same ids for every engine) and fed token by
token: before each token (and once more at the end, where the end token must be allowed) the engine fills
its token bitmask, timed alone (the "mask"); then it takes the token (the "advance", timed apart). Compile is
everything from the request's grammar to a matcher ready for its first mask (xgrammar's compiler cache off,
so every repeat compiles); the first mask is shown apart, and is in the mask statistics too; "request" is
compile + every mask + every advance of one output (how bunsan serves now: a grammar compiled per request).
The same matcher is then reset and walked again: its "warm" masks are what a cache of compiled grammars (as
vLLM keeps for xgrammar) would give a repeated grammar.

How each engine is asked, as its serving users get it: llguidance through bunsan's grammar_request (JSON as
json.dumps lays it out, regexes with ASCII \\d/\\w) and its LLMatcher, masks by llguidance.torch; xgrammar as
vLLM asks it (compile_json_schema with any_whitespace=False and json.dumps' separators, the builtin JSON
grammar for json_object, compile_regex, an EBNF alternation for a choice; GrammarCompiler(max_threads=
--threads), GrammarMatcher.fill_next_token_bitmask); outlines-core as vLLM's outlines back end did
(build_regex_from_schema with whitespace "[ ]?", Index, Guide.write_mask_into). Each engine runs in its own
subprocess (structured_worker.py), which prints one JSON line per case; xgrammar and outlines-core are
never imported into the pinned dev venv: they live in --peers-venv, made when missing (python -m venv;
pip install torch==2.13.0 xgrammar outlines-core).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PEERS_VENV = Path("/tmp/bunsan-structured-peers")
WORK = Path("/tmp/bunsan-bench-structured")
EOS = "<|endoftext|>"

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
        "name": {"type": "string", "minLength": 1, "maxLength": 60},
        "status": {"enum": ["active", "suspended", "closed", "pending_review"]},
        "score": {"type": "number", "minimum": 0, "maximum": 100},
        "verified": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 8},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string"},
                "city": {"type": "string"},
                "postcode": {"type": "string", "pattern": "^[0-9]{5}$"},
                "country": {"enum": ["US", "CA", "MX", "GB", "DE", "FR", "JP"]},
            },
            "required": ["street", "city", "postcode", "country"],
            "additionalProperties": False,
        },
        "orders": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "pattern": "^[a-z0-9]{8}$"},
                    "quantity": {"type": "integer", "minimum": 1, "maximum": 999},
                    "unit_price": {"type": "number", "minimum": 0},
                    "currency": {"enum": ["USD", "EUR", "GBP", "JPY"]},
                    "gift": {"type": "boolean"},
                },
                "required": ["sku", "quantity", "unit_price", "currency", "gift"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["id", "name", "status", "score", "verified", "tags", "address", "orders"],
    "additionalProperties": False,
}
DOCUMENT = {
    "id": "QXR-2048", "name": "Marguerite Okonkwo-Villanueva", "status": "pending_review", "score": 87.25,
    "verified": True, "tags": ["wholesale", "priority", "net-30", "eu-shipping"],
    "address": {"street": "1420 Harbor View Boulevard, Suite 300", "city": "San Francisco", "postcode": "94107",
                "country": "US"},
    "orders": [{"sku": "a1b2c3d4", "quantity": 12, "unit_price": 19.99, "currency": "USD", "gift": False},
               {"sku": "zz90xk11", "quantity": 1, "unit_price": 1249.5, "currency": "EUR", "gift": True},
               {"sku": "m0n1p2q3", "quantity": 250, "unit_price": 0.35, "currency": "GBP", "gift": False}],
}
ANY_OBJECT = {"event": "deploy", "ok": True, "took_ms": 5123, "targets": ["eu-west-1", "us-east-2"],
              "meta": {"by": "ci", "retries": [1, 2, None], "ratio": 0.75, "note": "rolled back twice"}}
REGEX = (r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01]) ([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9] "
         r"(DEBUG|INFO|WARN|ERROR) [a-z_]+(\.[a-z_]+)*: [A-Za-z0-9 ,.'()-]{1,200}")
REGEX_TEXT = ("2024-03-15 14:22:07 WARN http.client: Connection to api.example.com timed out after 30 seconds "
              "(retry 2 of 5), falling back to the cached response.")
CHOICES = ["Afghanistan", "Argentina", "Australia", "Bangladesh", "Belgium", "Brazil", "Canada", "Chile", "China",
           "Colombia", "Democratic Republic of the Congo", "Egypt", "Ethiopia", "France", "Germany", "Ghana",
           "India", "Indonesia", "Iran", "Italy", "Japan", "Kenya", "Mexico", "Morocco", "Netherlands", "Nigeria",
           "Pakistan", "Peru", "Philippines", "Poland", "Russia", "Saudi Arabia", "South Africa", "South Korea",
           "Spain", "Thailand", "Turkey", "United Kingdom of Great Britain and Northern Ireland",
           "United States of America", "Vietnam"]
CHOICE_TEXT = "United Kingdom of Great Britain and Northern Ireland"
CASES = [("json_schema", SCHEMA, json.dumps(DOCUMENT)), ("json_object", None, json.dumps(ANY_OBJECT)),
         ("regex", REGEX, REGEX_TEXT), ("choice", CHOICES, CHOICE_TEXT)]


# ---------------------------------------------------------------------------------------------- the driver

def train_bpe(vocab: int, work: Path) -> Path:
    """A byte-level BPE tokenizer.json of `vocab` tokens (at most: the corpus may give fewer) trained on the
    standard library's .py sources, with <|endoftext|> as its end token; cached."""
    path = work / f"bpe-{vocab}" / "tokenizer.json"
    if path.is_file():
        return path
    import sysconfig

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(f for f in stdlib.rglob("*.py") if "site-packages" not in f.parts)

    def texts():
        for f in files:
            try:
                yield f.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):        # a few test files are Latin-1 on purpose
                pass
    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    start = time.perf_counter()
    t.train_from_iterator(texts(), trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=[EOS], show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path.parent.mkdir(parents=True, exist_ok=True)
    t.save(str(path))
    print(f"trained {path}: {t.get_vocab_size()} tokens in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    return path


def case_file(vocab: str, work: Path) -> Path:
    """The vocabulary and every case's valid output as token ids of it (one tokenization for every engine)."""
    if vocab == "byte":
        spec = {"vocab": "byte", "size": 257, "eos": 256}
        encode = lambda text: list(text.encode())                  # noqa: E731
    else:
        from tokenizers import Tokenizer
        path = train_bpe(int(vocab), work)
        tok = Tokenizer.from_file(str(path))
        spec = {"vocab": str(path), "size": tok.get_vocab_size(), "eos": tok.token_to_id(EOS)}
        encode = lambda text: tok.encode(text).ids                 # noqa: E731
    spec["cases"] = []
    for name, grammar, text in CASES:
        ids = encode(text)
        spec["cases"].append({"name": name, "grammar": grammar, "text": text, "ids": ids})
    out = work / f"cases-{vocab}.json"
    out.write_text(json.dumps(spec))
    return out


def peers_python(venv: Path) -> Path:
    """The peers' venv (xgrammar, outlines-core; torch 2.13.0 CPU as xgrammar needs torch): made when missing.
    outlines-core is optional: a failed install leaves it out."""
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", "torch==2.13.0", "xgrammar", "transformers"],
                       check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", "outlines-core"], check=False)
    return python


def run_worker(python: Path, engine: str, cases: Path, a) -> list[dict]:
    """One engine over one vocabulary's cases in a subprocess: its JSON lines (a failure or a timeout is a
    line with "error")."""
    cmd = [str(python), str(HERE / "structured_worker.py"), engine, "--cases", str(cases),
           "--repeats", str(a.repeats), "--budget-s", str(a.budget_s), "--threads", str(a.threads)]
    env = {**os.environ, "PYTHONPATH": str(HERE.parent)} if engine == "llguidance" else dict(os.environ)
    env.pop("VIRTUAL_ENV", None)
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout, env=env)
        out, err, failed = done.stdout, done.stderr, done.returncode != 0
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        err, failed = f"timed out after {a.timeout} s", True
    lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    if failed:
        seen = {r.get("case") for r in lines}
        reason = err.strip().splitlines()[-1][:160] if err.strip() else "failed"
        lines += [{"engine": engine, "case": name, "error": reason} for name, _, _ in CASES if name not in seen]
    return lines


def _us(ns: float) -> str:
    return f"{ns / 1e3:.1f}"


def _ms(ns: float) -> str:
    return f"{ns / 1e6:.2f}"


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown"


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=HERE).stdout.strip() or "not recorded"
    except OSError:
        return "not recorded"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocabs", default="byte,32000,100000", help="byte and/or BPE vocabulary sizes to train")
    p.add_argument("--engines", default="llguidance,xgrammar,outlines")
    p.add_argument("--rounds", type=int, default=2, help="every engine in turn this many times, pooled")
    p.add_argument("--repeats", type=int, default=5, help="compiles and walks per case (fewer past --budget-s)")
    p.add_argument("--budget-s", type=float, default=20.0, help="no new repeat of a case past this many seconds")
    p.add_argument("--threads", type=int, default=1, help="xgrammar's compiler threads (llguidance compiles on one)")
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds per engine and vocabulary")
    p.add_argument("--peers-venv", type=Path, default=PEERS_VENV, help="xgrammar's and outlines-core's venv")
    p.add_argument("--work", type=Path, default=WORK, help="where the trained tokenizers and cases are kept")
    p.add_argument("--markdown", metavar="PATH", help="append the tables to PATH")
    a = p.parse_args(argv)
    a.work.mkdir(parents=True, exist_ok=True)
    engines = a.engines.split(",")
    peers = peers_python(a.peers_venv) if set(engines) - {"llguidance"} else None
    load_before = os.getloadavg()
    versions, pooled, order = {}, {}, []           # (label, case, engine) -> every round's measurements
    for round_ in range(a.rounds):
        for vocab in a.vocabs.split(","):
            cases = case_file(vocab, a.work)
            size = json.loads(cases.read_text())["size"]
            label = "byte (257)" if vocab == "byte" else f"BPE {size}"
            for engine in engines:
                print(f"round {round_ + 1}, {label}: {engine} ...", file=sys.stderr, flush=True)
                for r in run_worker(Path(sys.executable) if engine == "llguidance" else peers, engine, cases, a):
                    versions[engine] = r.get("version", versions.get(engine))
                    key = (label, r.get("case", "setup"), engine)
                    if key not in pooled:
                        order.append(key)
                    got = pooled.setdefault(key, {})
                    for k, v in r.items():
                        got[k] = got.get(k, []) + v if isinstance(v, list) else (got.get(k, 0) + v if k in (
                            "repeats", "setup_ns") else v)
                    print(json.dumps({k: v for k, v in r.items() if not isinstance(v, list)}), file=sys.stderr)
    rows, setup = [], []
    for key in order:
        label, case, engine = key
        r = pooled[key]
        if case == "setup":
            setup.append([label, engine, _ms(r["setup_ns"] / a.rounds)])
        elif "error" in r or not r.get("mask_ns"):
            rows.append([label, case, engine, "n/a", "", "", "", "", "", "", "", "", "", r.get("error", "")])
        else:
            m = r["mask_ns"]
            rows.append([label, case, engine, _ms(statistics.median(r["compile_ns"])),
                         _us(statistics.median(r["first_mask_ns"])), _us(statistics.fmean(m)), _us(statistics.median(m)),
                         _us(_pct(m, 0.99)), _us(statistics.fmean(r["advance_ns"])), str(r["steps"]),
                         _ms(statistics.median(r["request_ns"])), _us(statistics.fmean(r["warm_mask_ns"])),
                         _us(statistics.median(r["warm_mask_ns"])), f"{r['repeats']} repeats"])
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"- date: {now}", f"- commit: {commit()}",
             f"- machine: {platform.machine()} ({cpu_model()}), {os.cpu_count()} CPUs, Python {platform.python_version()}",
             f"- command: `python {shlex.join(sys.argv)}`",
             "- engines: " + ", ".join(f"{e} {v}" for e, v in versions.items()),
             f"- xgrammar compiler threads: {a.threads}; {a.rounds} rounds of every engine in turn, each up to "
             f"{a.repeats} repeats of a case (fewer past {a.budget_s:g} s); compile, first mask and request are "
             "medians over all repeats, mask and advance statistics pool every step of every repeat; request = "
             "compile + every mask + every advance of one output; warm: the masks of a second walk of the same "
             "matcher, reset (as a cache of compiled grammars would serve a repeated grammar)",
             f"- load average (1 min) before and after: {load_before[0]:.1f}, {os.getloadavg()[0]:.1f}", "",
             "| vocabulary | case | engine | compile ms | first mask µs | mask mean µs | mask p50 µs | mask p99 µs "
             "| advance mean µs | steps | request ms | warm mask mean µs | warm mask p50 µs | note |",
             "|" + "---|" * 14]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    lines += ["", "Tokenizer setup (once per server: the vocabulary indexed):", "",
              "| vocabulary | engine | setup ms |", "|---|---|---|"]
    lines += ["| " + " | ".join(r) + " |" for r in setup]
    text = "\n".join(lines)
    print(text)
    if a.markdown:
        with open(a.markdown, "a") as f:
            f.write(text + "\n\n")
    return 0


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


if __name__ == "__main__":
    sys.exit(main())
