r"""Structured outputs: a sequence's tokens held to a grammar, valid by construction (llguidance, the grammar
engine vLLM and SGLang use: a token mask per step from the tokenizer's own vocabulary).

What a request may ask, as OpenAI and vLLM spell it:
    response_format  {"type": "json_object"} | {"type": "json_schema", "json_schema": {"schema": {...}}}
    structured_outputs (vLLM)  {"json": schema} | {"regex": "..."} | {"choice": [...]} | {"grammar": lark}
    guided_json / guided_regex / guided_choice / guided_grammar (vLLM's older names)
Before each draw the tokens the grammar cannot take next are masked out; once the grammar is complete and
can take nothing more, the sequence ends (finish_reason "stop"), at the model's end token or without one.

Character classes are ASCII, as xgrammar (vLLM's default back end) and JSON Schema's ECMA-262 `pattern` read
them: in a regex constraint `\d` is [0-9] and `\w` is [0-9a-zA-Z_] (`\D`, `\W` their complements), where
llguidance's own regex syntax (Rust's regex crate) reads them as Unicode (`\d{2}` would take '߁꩙'; so does
outlines-core 0.2, measured: its `\d` takes '٣'). The pattern goes through llguidance's
regex_to_lark(pattern, "dw"), the rewrite its JSON-schema compiler applies to every `pattern`: it follows
escapes (`\\d` stays a backslash and a d) and works inside classes (`[\d.]` is `[[0-9].]`, a nested class);
`\s` stays Unicode white space, as ECMA-262 (and xgrammar) have it. A Lark grammar (structured_outputs.grammar)
is taken as written: its /regex/ terminals keep llguidance's classes.
llguidance against xgrammar and outlines-core: benchmarks/bench_structured.py (RESULTS.md). Compiled per
request, as here, llguidance costs the least for JSON schemas, JSON objects and regexes (xgrammar takes seconds
on a bounded repetition like {1,200}); xgrammar's per-token masks are cheaper once compiled (2-8x on a JSON
schema over a BPE vocabulary), which a cache of compiled grammars would bring out.
"""

from __future__ import annotations

import json
import re

import torch

from bunsan.serve.errors import ApiError, shown

LEGACY = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
# JSON as json.dumps writes it: free whitespace would let a model pad forever between the tokens that matter
# (a schema's own "x-guidance" options still win)
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def grammar_request(response_format, structured: dict | None, legacy: dict) -> str | None:
    """The llguidance grammar a request asks for (None: free text); a 400 naming what is wrong."""
    asked = [(f"structured_outputs.{k}", k, v) for k, v in (structured or {}).items() if v is not None]
    asked += [(name, LEGACY[name], v) for name, v in legacy.items() if v is not None]
    if response_format is not None:
        kind = response_format.get("type") if isinstance(response_format, dict) else None
        if kind == "json_schema":
            spec = response_format.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise ApiError(400, "response_format json_schema needs json_schema.schema, a JSON schema object",
                               param="response_format")
            asked.append(("response_format", "json", schema))
        elif kind == "json_object":
            asked.append(("response_format", "json", {"type": "object"}))
        elif kind != "text":
            raise ApiError(400, f"response_format type {shown(kind)} is not one of text, json_object, json_schema",
                           param="response_format")
    if len(asked) > 1:
        raise ApiError(400, f"{' and '.join(a[0] for a in asked)} both constrain the output; send one",
                       param=asked[1][0])
    if not asked:
        return None                      # free text needs no grammar library: serving works without llguidance
    param, kind, value = asked[0]
    llguidance = _llguidance(param)
    if kind == "json":
        if not isinstance(value, (dict, bool)):
            raise ApiError(400, f"{param} is {shown(value)}; a JSON schema is an object", param=param)
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(value), defaults=JSON_LAYOUT)
    elif kind == "regex":
        if not isinstance(value, str):
            raise ApiError(400, f"{param} is {shown(value)}; a regular expression is a string", param=param)
        grammar = llguidance.LLMatcher.grammar_from_regex(ascii_classes(value))
    elif kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise ApiError(400, f"{param} is {shown(value)}; a choice is a non-empty list of strings", param=param)
        grammar = llguidance.LLMatcher.grammar_from_regex("|".join(re.escape(c) for c in value))
    elif kind == "grammar":
        if not isinstance(value, str):
            raise ApiError(400, f"{param} is {shown(value)}; a grammar is Lark text", param=param)
        grammar = llguidance.LLMatcher.grammar_from_lark(value)
    else:
        raise ApiError(400, f"{param}: unknown constraint {shown(kind)}; use json, regex, choice or grammar",
                       param=param)
    problem = llguidance.LLMatcher.validate_grammar(grammar)
    if problem and not problem.startswith("WARNING"):
        raise ApiError(400, f"{param} cannot be used: {problem}", param=param)
    return grammar


def _llguidance(param: str):
    """llguidance, or a 501 naming the install (it is `bunsan[serve]`'s, optional for free-text serving)."""
    try:
        import llguidance
    except ImportError as e:
        raise ApiError(501, f"{param}: structured outputs need llguidance, which this server's Python lacks "
                       f"({e}); install it (pip install 'bunsan[serve]' or llguidance) and restart the server",
                       param=param) from None
    return llguidance


def ascii_classes(pattern: str) -> str:
    r"""`pattern` with `\d` as [0-9] and `\w` as [0-9a-zA-Z_] (and their complements), escapes and classes
    respected: what xgrammar and ECMA-262 read (the module's docstring)."""
    import llguidance
    return llguidance.regex_to_lark(pattern, "dw")


def grammar_tokenizer(tokenizer, vocab_size: int, end_ids: list[int]):
    """The tokenizer as llguidance reads it (built once per server: it indexes the whole vocabulary)."""
    import llguidance

    from bunsan.models.model_dir import ROLES, read_text
    path = getattr(tokenizer, "path", None)
    if path is not None:                      # a Hugging Face tokenizer.json (read as model_dir.py reads one)
        return llguidance.LLTokenizer(read_text(path, ROLES["tokenizer.json"]), n_vocab=vocab_size,
                                      eos_token=end_ids or None)
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(ByteVocabulary(vocab_size)))


class ByteVocabulary:
    """bunsan's byte tokenizer for llguidance: token i is byte i; an end token past the model's vocabulary
    (the model never draws it: a complete grammar ends the sequence instead)."""

    def __init__(self, vocab_size: int):
        self.tokens = [bytes([i]) for i in range(256)] + [b""] * (vocab_size - 256) + [b"<end>"]
        self.eos_token_id, self.bos_token_id = len(self.tokens) - 1, None
        self.special_token_ids = [self.eos_token_id]

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


class Constraint:
    """One sequence's position in its grammar."""

    def __init__(self, lltok, grammar: str):
        import llguidance
        import llguidance.torch
        self.grammar = grammar           # (what a server's model process builds its own from: engine.py)
        self.matcher = llguidance.LLMatcher(lltok, grammar)
        if self.matcher.is_error():
            raise ApiError(400, f"the output constraint cannot be used: {self.matcher.get_error()}")
        self.bits = llguidance.torch.allocate_token_bitmask(1, lltok.vocab_size)
        self.fill = llguidance.torch.fill_next_token_bitmask
        self.shifts = torch.arange(32, dtype=torch.int32)

    def allowed(self, vocab: int) -> torch.Tensor:
        """[vocab] bool: the tokens the grammar takes next."""
        self.fill(self.matcher, self.bits)
        return ((self.bits[0, :, None] >> self.shifts) & 1).reshape(-1)[:vocab].bool()

    def done(self) -> bool:
        """The grammar is complete and takes nothing more."""
        return self.matcher.is_stopped()

    def take(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise RuntimeError(f"the grammar refused token {token}: {self.matcher.get_error()}")
