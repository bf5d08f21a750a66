"""Structured outputs on `bunsan serve` (structured.py, llguidance): a tiny random model's answers follow the
JSON schema, regex, choice or Lark grammar asked for, valid by construction, through the official openai
client's parse helper, vLLM's fields and Ollama's `format`; a constraint that cannot be used is a 400."""

from __future__ import annotations

import json
import re

import pytest

from parity import tiny_model

pytest.importorskip("llguidance")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
pydantic = pytest.importorskip("pydantic")

from serve_harness import Server  # noqa: E402


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
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


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
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60, json={
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
