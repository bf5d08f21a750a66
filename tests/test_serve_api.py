"""`bunsan serve` through the clients its users bring: the official `openai` client (completions in every
prompt form, n, logprobs and echo, streaming with usage, chat, models, errors), Ollama's native API, chat
templates (the checkpoint's through transformers, the default ChatML), prefix reuse, and the sampler."""

from __future__ import annotations

import json
import math

import pytest
import torch

from parity import tiny_model

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
try:
    import openai
except ImportError:          # requirements-dev.txt pins it; without it only the tests through it are skipped
    openai = None
needs_openai = pytest.mark.skipif(openai is None, reason="the openai client is not installed: "
                                                         "pip install -r requirements-dev.txt")

from serve_harness import CEILING_S, PROMPTS, Server, http_get, http_stream, offline  # noqa: E402  (httpx, uvicorn)
from serve_harness import one_torch_thread  # noqa: E402,F401  (autouse: torch on one thread here)


@pytest.fixture(scope="module")
def model():
    return tiny_model(0).eval()


@pytest.fixture(scope="module")
def server(model):
    s = Server(model, slots=4, context=128, max_tokens=64, app={"aliases": ("tiny", "alias")})
    yield s
    s.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=CEILING_S)


def chatml(messages) -> str:
    from bunsan.serve.chat import DEFAULT_TEMPLATE
    from transformers.utils.chat_template_utils import render_jinja_template
    return render_jinja_template([messages], chat_template=DEFAULT_TEMPLATE, add_generation_prompt=True)[0][0]


@needs_openai
def test_completions_in_every_prompt_form(client, server, model):
    tok = server.tokenizer
    want = [offline(model, tok, p, 10) for p in PROMPTS[:2]]
    r = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=10, temperature=0)
    assert r.choices[0].text == want[0] and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(tok.encode(PROMPTS[0])) and r.usage.completion_tokens == 10
    for prompt in (PROMPTS[:2], [tok.encode(p) for p in PROMPTS[:2]]):
        r = client.completions.create(model="alias", prompt=prompt, max_tokens=10, temperature=0, n=2)
        assert [c.index for c in r.choices] == [0, 1, 2, 3]
        assert [c.text for c in r.choices] == [want[0], want[0], want[1], want[1]]
        assert r.usage.completion_tokens == 40
    r = client.completions.create(model="tiny", prompt=tok.encode(PROMPTS[1]), max_tokens=10, temperature=0)
    assert r.choices[0].text == want[1]


@needs_openai
def test_streamed_completions_with_usage(client, server, model):
    want = offline(model, server.tokenizer, PROMPTS[3], 20)
    chunks = list(client.completions.create(model="tiny", prompt=PROMPTS[3], max_tokens=20, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20


@needs_openai
def test_logprobs_and_echo(client, server, model):
    tok, prompt = server.tokenizer, PROMPTS[4]
    ids = tok.encode(prompt)
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0, logprobs=3, echo=True)
    c = r.choices[0]
    assert c.text == prompt + offline(model, tok, prompt, 6)
    lp = c.logprobs
    assert len(lp.tokens) == len(ids) + 6 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    with torch.no_grad():
        logits = model(torch.tensor([ids]))[0].float()
    first = torch.log_softmax(logits[0], -1)[ids[1]].item()             # the prompt's second token, given its first
    assert math.isclose(lp.token_logprobs[1], first, abs_tol=1e-4)
    for chosen, top in zip(lp.token_logprobs[len(ids):], lp.top_logprobs[len(ids):]):
        assert len(top) == 3 and math.isclose(chosen, max(top.values()), abs_tol=1e-6)   # greedy takes the top
    assert lp.text_offset[:3] == [0, 1, 2]
    scored = client.completions.create(model="tiny", prompt=prompt, max_tokens=0, echo=True, logprobs=0)
    assert scored.choices[0].text == prompt and scored.usage.completion_tokens == 0


@needs_openai
def test_chat_completions(client, server, model):
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def"}]
    want = offline(model, server.tokenizer, chatml(messages), 12)
    want = want[:want.find("<|im_end|>")] if "<|im_end|>" in want else want
    r = client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=12, temperature=0,
                                       logprobs=True, top_logprobs=2)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want
    assert len(r.choices[0].logprobs.content) == r.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 for t in r.choices[0].logprobs.content)
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert chunks[-1].usage.total_tokens == r.usage.total_tokens
    two = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0.9, seed=5, n=2)
    again = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0.9, seed=5,
                                           n=2)
    texts = [c.message.content for c in two.choices]
    assert texts == [c.message.content for c in again.choices] and texts[0] != texts[1]


@needs_openai
def test_models_and_a_wrong_model(client):
    assert [m.id for m in client.models.list()] == ["tiny", "alias"]
    assert client.models.retrieve("alias").id == "alias"
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4")
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError, match="gpt-4"):
        client.completions.create(model="gpt-4", prompt="x", max_tokens=2)


@needs_openai
def test_errors_reach_the_client_in_openai_shape(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="x", max_tokens=65)
    assert "limit of 64" in e.value.body["message"] and e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError, match="suffix is not supported"):
        client.completions.create(model="tiny", prompt="x", suffix="y")
    with pytest.raises(openai.BadRequestError, match="tools"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                       tools=[{"type": "function", "function": {"name": "f"}}])


@needs_openai
def test_best_of_returns_the_likeliest(client):
    r = client.completions.create(model="tiny", prompt="x", max_tokens=6, temperature=1.0, seed=1, best_of=3,
                                  logprobs=0)
    assert len(r.choices) == 1 and r.usage.completion_tokens == 18          # all three were generated
    singles = [client.completions.create(model="tiny", prompt="x", max_tokens=6, temperature=1.0, seed=1 + j,
                                         logprobs=0).choices[0] for j in range(3)]
    best = max(singles, key=lambda c: sum(c.logprobs.token_logprobs))
    assert r.choices[0].text == best.text


def test_ollama_generate_chat_and_tags(server, model):
    want = offline(model, server.tokenizer, PROMPTS[5], 8)
    body = {"model": "tiny", "prompt": PROMPTS[5], "options": {"temperature": 0, "num_predict": 8, "num_ctx": 64}}
    whole = server.post(body | {"stream": False}, path="/api/generate").json()
    assert whole["response"] == want and whole["done"] and whole["eval_count"] == 8
    with http_stream("POST", server.url + "/api/generate", json=body) as r:
        assert r.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in r.iter_lines() if line]
    assert "".join(x["response"] for x in lines) == want and lines[-1]["done_reason"] == "length"
    prompt = server.tokenizer.encode(PROMPTS[5])
    assert lines[-1]["context"][:len(prompt)] == prompt and len(lines[-1]["context"]) == len(prompt) + 8
    messages = [{"role": "user", "content": "def"}]
    chat = server.post({"model": "tiny:latest", "messages": messages, "stream": False,
                        "options": {"temperature": 0, "num_predict": 6}}, path="/api/chat").json()
    assert chat["message"]["content"] == offline(model, server.tokenizer, chatml(messages), 6)
    assert [m["name"] for m in http_get(server.url + "/api/tags").json()["models"]] == ["tiny", "alias"]
    missing = server.post({"model": "llama3", "prompt": "x"}, path="/api/generate")
    assert missing.status_code == 404 and "llama3" in missing.json()["error"]
    assert server.post({"model": "tiny", "prompt": "x", "options": {"mirostat": 2}}, path="/api/generate"
                       ).status_code == 400


def test_the_checkpoints_chat_template_through_transformers(tmp_path):
    """A tokenizer_config.json chat_template is rendered by transformers, its special tokens encoded as such."""
    tokenizers = pytest.importorskip("tokenizers")
    from bunsan.models.hf import has_chat_template as has_template
    from bunsan.serve.chat import ChatTemplate
    from bunsan.training.tokenizer import HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    t = tokenizers.Tokenizer(models.BPE(vocab, []))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    t.decoder = decoders.ByteLevel()
    t.add_special_tokens(["<|turn|>", "<|end|>"])
    t.save(str(tmp_path / "tokenizer.json"))
    template = ("{% for m in messages %}<|turn|>{{ m['role'] | upper }}: {{ m['content'] }}<|end|>{% endfor %}"
                "{% if add_generation_prompt %}<|turn|>ASSISTANT: {% endif %}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": template, "eos_token": "<|end|>"}))
    assert has_template(tmp_path)
    tok = HFTokenizer(tmp_path)
    chat = ChatTemplate(tok, tmp_path)
    ids = chat.render([{"role": "user", "content": "hi"}])
    assert tok.decode(ids) == "<|turn|>USER: hi<|end|><|turn|>ASSISTANT: "
    assert ids[0] == 256 and ids.count(257) == 1 and chat.eos_ids == {257} and chat.stop == []
    s = Server(tiny_model(0, vocab_size=258).eval(), slots=2, context=64, tokenizer=tok, app={"template": chat})
    try:
        r = s.post({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0},
                   path="/v1/chat/completions")
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(ids)
    finally:
        s.close()


def test_prefix_reuse_keeps_greedy_output_and_skips_the_shared_prefill(model):
    shared = "# a long shared system prompt, as chats have\n" * 2
    prompts = [shared + p for p in PROMPTS[:3]]
    for reuse in (True, False):
        s = Server(model, slots=2, context=160, prefix_reuse=reuse, max_tokens=16)
        try:
            texts = [s.post({"prompt": p, "max_tokens": 8, "temperature": 0}).json()["choices"][0]["text"]
                     for p in prompts]
            n = s.post({"prompt": prompts[0], "max_tokens": 8, "temperature": 0, "n": 2}).json()
            reused = s.batcher.reused_tokens
        finally:
            s.close()
        assert texts == [offline(model, s.tokenizer, p, 8) for p in prompts]
        assert [c["text"] for c in n["choices"]] == [texts[0]] * 2
        assert (reused >= 3 * len(shared)) if reuse else reused == 0


def test_the_sampler_applies_penalties_bias_and_min_p():
    from bunsan.serve.sampling import RowSampler, SamplingParams
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0])
    greedy = RowSampler(SamplingParams(frequency_penalty=0.6, presence_penalty=0.5), [3], 4)
    assert greedy.draw(logits).id == 0 and greedy.draw(logits).id == 1          # 2 - 1.1 < 1.0
    rep = RowSampler(SamplingParams(repetition_penalty=4.0), [0], 4)             # 2/4 = 0.5 < 1.0
    assert rep.draw(logits).id == 1
    assert RowSampler(SamplingParams(logit_bias={3: 10.0}), [0], 4).draw(logits).id == 3
    picked = {RowSampler(SamplingParams(temperature=1.0, min_p=0.3, seed=s), [0], 4).draw(logits).id
              for s in range(40)}
    assert picked == {0, 1}                        # p(1)/p(0) = e^-1 > 0.3 > e^-1.5 = p(2)/p(0)
    top = RowSampler(SamplingParams(logprobs=2), [0], 4).draw(logits)
    assert top.top[0][0] == 0 and math.isclose(top.logprob, torch.log_softmax(logits, -1)[0].item())


@pytest.mark.parametrize("content,ids", [
    ({"eos_token_id": 7}, {7}), ({"eos_token_id": [128001, 128009]}, {128001, 128009}),
    ({"max_new_tokens": 5}, set()), ({"eos_token_id": "7"}, set()), ({"eos_token_id": [1, True]}, set()),
    (None, set()),
])
def test_end_of_turn_ids_come_from_generation_config(tmp_path, content, ids, caplog):
    """generation_config.json's eos_token_id, one id or a list (Llama 3 ends a turn with <|eot_id|>, not
    tokenizer.json's first end token); a file that says something else is warned and ignored."""
    from bunsan.serve.chat import generation_eos_ids
    (tmp_path / "generation_config.json").write_text("not json {" if content is None else json.dumps(content))
    assert generation_eos_ids(tmp_path) == ids
    assert ("eos_token_id as one id or a list" in caplog.text) == (content is None or "eos_token_id" in content
                                                                   and not ids)
    assert generation_eos_ids(tmp_path / "missing") == set()
