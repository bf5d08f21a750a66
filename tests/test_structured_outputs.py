r"""Structured outputs on `bunsan serve` (structured.py, llguidance): a tiny random model's answers follow the
JSON schema, regex, choice or Lark grammar asked for, valid by construction, through the official openai
client's parse helper, vLLM's fields and Ollama's `format`; a constraint that cannot be used is a 400. A regex's
`\d` and `\w` are ASCII (as xgrammar and ECMA-262 read them), also where the model would rather draw
another script's digits; and all of it over a trained BPE tokenizer.json as over the byte tokenizer."""

from __future__ import annotations

import json
import re
import sys

import pytest

from parity import tiny_model

pytest.importorskip("llguidance")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
pydantic = pytest.importorskip("pydantic")

from serve_harness import CEILING_S, Server, http_stream  # noqa: E402
from serve_harness import one_torch_thread  # noqa: E402,F401  (autouse: torch on one thread here)


class Weather(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=12)
    sunny: bool
    degrees: int = pydantic.Field(ge=-40, le=50)


@pytest.fixture(scope="module")
def server():
    s = Server(tiny_model(0).eval(), slots=4, context=256, max_tokens=200)
    yield s
    s.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=CEILING_S)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_openai_clients_parse_helper_gets_a_valid_object(client, temperature):
    completion = client.chat.completions.parse(
        model="tiny", messages=[{"role": "user", "content": "Weather in Rome?"}], response_format=Weather,
        max_tokens=150, temperature=temperature, seed=3)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop", choice
    assert isinstance(choice.message.parsed, Weather)
    assert -40 <= choice.message.parsed.degrees <= 50


def test_json_object_regex_choice_and_grammar(server):
    asked = [({"response_format": {"type": "json_object"}}, lambda t: isinstance(json.loads(t), dict)),
             ({"structured_outputs": {"regex": r"[a-c]{3}-\d{2}"}}, lambda t: re.fullmatch(r"[a-c]{3}-\d{2}", t)),
             ({"guided_choice": ["yes", "no", "maybe"]}, lambda t: t in ("yes", "no", "maybe")),
             ({"structured_outputs": {"grammar": 'start: "x" | "x+x" | "x+x+x"'}},
              lambda t: t in ("x", "x+x", "x+x+x"))]
    for extra, valid in asked:
        r = server.post({"prompt": "Answer:", "max_tokens": 120, "temperature": 1.0, "seed": 1, **extra})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "stop" and valid(choice["text"]), (extra, choice)


def test_streamed_and_n_sequences_each_follow_the_grammar(server):
    r = server.post({"messages": [{"role": "user", "content": "pick"}], "n": 3, "temperature": 1.0, "seed": 5,
                     "guided_choice": ["alpha", "beta"]}, path="/v1/chat/completions")
    assert r.status_code == 200, r.text
    assert {c["message"]["content"] for c in r.json()["choices"]} <= {"alpha", "beta"}
    with http_stream("POST", server.url + "/v1/completions", json={
            "prompt": "n=", "stream": True, "max_tokens": 50, "guided_regex": r"\d{4}"}) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert re.fullmatch(r"\d{4}", "".join(e["choices"][0]["text"] for e in events))


def test_ollamas_format(server):
    # (any JSON value may be a number without end: greedy here gives a string, which ends)
    closed = {**Weather.model_json_schema(), "additionalProperties": False}      # (else any more keys may follow)
    for fmt, options in [("json", {"temperature": 0}), (closed, {"seed": 2})]:
        r = server.post({"model": "tiny", "prompt": "weather", "stream": False, "format": fmt,
                         "options": {"num_predict": 150, **options}}, path="/api/generate")
        assert r.status_code == 200, r.text
        assert r.json()["done_reason"] == "stop", (fmt, r.json())
        value = json.loads(r.json()["response"])
        if fmt != "json":
            Weather.model_validate(value)


@pytest.mark.parametrize("extra,words", [
    ({"response_format": {"type": "xml"}}, "is not one of text, json_object, json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "needs json_schema.schema"),
    ({"guided_regex": "(unclosed"}, "guided_regex cannot be used"),
    ({"guided_choice": []}, "a choice is a non-empty list of strings"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "both constrain the output"),
    ({"structured_outputs": {"json": 5}}, "a JSON schema is an object")])
def test_a_constraint_that_cannot_be_used_is_a_400(server, extra, words):
    r = server.post({"prompt": "x", "max_tokens": 5, **extra})
    assert r.status_code == 400 and words in r.json()["error"]["message"], r.text


def _accepts(grammar: str, text: str) -> bool:
    """Whether llguidance's matcher, over the byte tokenizer, takes all of `text` and may end there."""
    import llguidance
    from bunsan.serve.structured import ByteVocabulary
    matcher = llguidance.LLMatcher(llguidance.LLTokenizer(llguidance.TokenizerWrapper(ByteVocabulary(256))), grammar,
                                   log_level=0)
    return all(matcher.consume_token(b) for b in text.encode()) and matcher.is_accepting()


@pytest.mark.parametrize("pattern,rewritten,takes,refuses", [
    (r"[a-c]{3}-\d{2}", r"[a-c]{3}-[0-9]{2}", ["abc-12"], ["aac-\u07c1\uaa59", "abc-\u0663\u0661"]),
    (r"\\d", r"\\d", ["\\d"], ["1", "\\1"]),                       # an escaped backslash, then a d
    (r"\\\d", r"\\[0-9]", ["\\7"], ["\\\u0667", "\\d"]),            # an escaped backslash, then \d
    (r"[\d.]+", r"[[0-9].]+", ["3.14"], ["\u0663.1"]),                # inside a class
    (r"[^\d]", r"[^[0-9]]", ["x", "\u0663"], ["3"]),
    (r"\D\W", r"[^0-9][^0-9a-zA-Z_]", ["\u0663-", "a\u00e9"], ["1-", "a_"]),
    (r"\w+", r"[0-9a-zA-Z_]+", ["a_Z9"], ["caf\u00e9", "\u0663"]),
    (r"[\w-]+", r"[[0-9a-zA-Z_]-]+", ["a-b"], ["\u00e9"]),
    (r"\p{Nd}", r"\p{Nd}", ["\u0663", "3"], ["x"]),                   # Unicode digits still there when asked
    (r"\s", r"\s", [" ", "\t"], ["x"]),                              # \s as llguidance (and ECMA-262) reads it
    (r"a/b\.c", r"a\/b\.c", ["a/b.c"], ["a/bxc"]),
])
def test_the_rewrite_makes_d_and_w_ascii_and_respects_escapes_and_classes(pattern, rewritten, takes, refuses):
    import llguidance
    from bunsan.serve.structured import ascii_classes, grammar_request
    assert ascii_classes(pattern) == rewritten
    grammar = grammar_request(None, {"regex": pattern}, {})
    assert grammar == llguidance.LLMatcher.grammar_from_regex(rewritten)
    for text in takes:
        assert _accepts(grammar, text), (pattern, text)
    for text in refuses:
        assert not _accepts(grammar, text), (pattern, text)


def test_a_json_schemas_pattern_is_ecma_262():
    r"""llguidance's JSON-schema compiler already reads `pattern` so: \d and \w ASCII."""
    from bunsan.serve.structured import grammar_request
    grammar = grammar_request({"type": "json_schema", "json_schema": {"schema": {
        "type": "object", "properties": {"code": {"type": "string", "pattern": "^\\w{2}\\d{2}$"}},
        "required": ["code"], "additionalProperties": False}}}, None, {})
    assert _accepts(grammar, '{"code": "ab12"}')
    assert not _accepts(grammar, '{"code": "ab\u0663\u0661"}') and not _accepts(grammar, '{"code": "\u00e9b12"}')


# the UTF-8 lead bytes of Arabic-Indic (U+0660..), NKo (U+07C0..), Devanagari (U+0966..) digits and the
# continuation bytes that follow them: a byte model biased to these would write another script's digits
NON_ASCII_DIGIT_BYTES = [0xD9, 0xDF, 0xE0, 0xA5] + list(range(0x80, 0x8A)) + list(range(0xA0, 0xAA))


def test_a_regexs_digits_are_ascii_where_the_model_favours_other_scripts(server):
    bias = {str(b): 100 for b in NON_ASCII_DIGIT_BYTES}
    for extra in [{"structured_outputs": {"regex": r"[a-c]{3}-\d{2}"}}, {"guided_regex": r"\w{4}"}]:
        r = server.post({"prompt": "Code:", "max_tokens": 40, "temperature": 1.0, "seed": 11, "n": 4,
                         "logit_bias": bias, **extra})
        assert r.status_code == 200, r.text
        for choice in r.json()["choices"]:
            text = choice["text"]
            assert choice["finish_reason"] == "stop" and text.isascii(), (extra, text)
            assert re.fullmatch(r"[a-c]{3}-[0-9]{2}|[0-9a-zA-Z_]{4}", text), (extra, text)


UNICODE_DIGITS = "\u0660\u0661\u0662\u0663\u0664\u0665\u0666\u0667\u0668\u0669\u07c0\u07c1\u0966\u0967\uaa59"


def _bpe_tokenizer(folder):
    """A byte-level BPE tokenizer.json trained here (vocab 1000) on Python's own json package and on digits of
    other scripts, so that whole Unicode digits are single tokens."""
    import json as json_module
    from pathlib import Path
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    corpus = [f.read_text() for f in sorted(Path(json_module.__file__).parent.glob("*.py"))]
    corpus += ["\n".join(UNICODE_DIGITS)] * 200 + ['{"city": "Rome", "sunny": true, "degrees": 21}'] * 20
    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    t.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=1000, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    folder.mkdir(parents=True, exist_ok=True)
    t.save(str(folder / "tokenizer.json"))


@pytest.fixture(scope="module")
def bpe_server(tmp_path_factory):
    pytest.importorskip("tokenizers")
    from bunsan.training.tokenizer import HFTokenizer
    folder = tmp_path_factory.mktemp("bpe")
    _bpe_tokenizer(folder)
    tok = HFTokenizer(folder)
    assert tok.vocab_size == 1000 and tok.eos_token_id == 0
    s = Server(tiny_model(0, vocab_size=tok.vocab_size).eval(), slots=4, context=256, tokenizer=tok, max_tokens=200)
    yield s
    s.close()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_parse_helper_over_a_bpe_tokenizer(bpe_server, temperature):
    client = openai.OpenAI(base_url=bpe_server.url + "/v1", api_key="unused", max_retries=0, timeout=CEILING_S)
    completion = client.chat.completions.parse(
        model="tiny", messages=[{"role": "user", "content": "Weather in Rome?"}], response_format=Weather,
        max_tokens=150, temperature=temperature, seed=4)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop", choice
    assert isinstance(choice.message.parsed, Weather) and -40 <= choice.message.parsed.degrees <= 50
    assert completion.usage.completion_tokens < len(choice.message.content)      # BPE tokens, not bytes


def test_bpe_regex_choice_and_digits_of_other_scripts(bpe_server):
    tok = bpe_server.tokenizer
    whole = [tok.encode(d) for d in UNICODE_DIGITS]
    assert all(len(ids) == 1 for ids in whole)                      # each one token: the model may draw it
    bias = {str(ids[0]): 100 for ids in whole}
    asked = [({"structured_outputs": {"regex": r"[a-c]{3}-\d{2}"}, "logit_bias": bias},
              lambda t: re.fullmatch(r"[a-c]{3}-[0-9]{2}", t)),
             ({"structured_outputs": {"regex": r"\p{Nd}{2}"}, "logit_bias": bias},    # asked for: any script
              lambda t: len(t) == 2 and not t.isascii() and all(c.isdecimal() for c in t)),
             ({"guided_choice": ["north", "south", "east west"]}, lambda t: t in ("north", "south", "east west")),
             ({"structured_outputs": {"json": {"type": "object", "properties": {"ok": {"type": "boolean"}},
                                               "required": ["ok"], "additionalProperties": False}}},
              lambda t: json.loads(t) in ({"ok": True}, {"ok": False}))]
    for extra, valid in asked:
        r = bpe_server.post({"prompt": "Answer:", "max_tokens": 120, "temperature": 1.0, "seed": 2, "n": 3,
                             **extra})
        assert r.status_code == 200, r.text
        for choice in r.json()["choices"]:
            assert choice["finish_reason"] == "stop" and valid(choice["text"]), (extra, choice)


def test_without_llguidance_free_text_needs_nothing_and_a_constraint_is_a_clear_501(monkeypatch):
    """llguidance is `bunsan[serve]`'s optional extra: a plain completion must not import it (the GPU check's
    server answered every plain completion 500 where it was missing), and a constraint says what to install."""
    from bunsan.serve.errors import ApiError
    from bunsan.serve.structured import grammar_request
    monkeypatch.setitem(sys.modules, "llguidance", None)          # import llguidance -> ImportError
    assert grammar_request(None, None, {}) is None
    assert grammar_request({"type": "text"}, None, {}) is None
    with pytest.raises(ApiError) as e:
        grammar_request({"type": "json_object"}, None, {})
    assert e.value.status == 501 and "llguidance" in e.value.message and "pip install" in e.value.message
    assert e.value.param == "response_format"
