"""`bunsan serve`'s other endpoints: embeddings (OpenAI's through the official client, float and base64; Ollama's
/api/embed and /api/embeddings) equal to the model's own last-token hidden state, normalised; Prometheus
/metrics counting what was served; Ollama's /api/show and /api/ps."""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch

from parity import tiny_model

pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
openai = pytest.importorskip("openai")

from serve_harness import CEILING_S, Server, http_get, http_post, http_stream, wait_for  # noqa: E402
from serve_harness import one_torch_thread  # noqa: E402,F401  (autouse: torch on one thread here)


@pytest.fixture(scope="module")
def model():
    return tiny_model(0).eval()


@pytest.fixture(scope="module")
def server(model):
    s = Server(model, slots=2, context=128, max_tokens=32)
    yield s
    s.close()


def _own_embedding(model, ids: list[int]) -> torch.Tensor:
    """The plain model's hidden state after the final norm at the last token, normalised (written here)."""
    with torch.no_grad():
        x = model.embed_tokens(torch.tensor([ids]))
        cos, sin = model.rope_cos[:len(ids)], model.rope_sin[:len(ids)]
        for layer in model.layers:
            x = layer(x, cos, sin)
        return torch.nn.functional.normalize(model.norm(x)[0, -1], dim=0)


def test_embeddings_are_the_models_last_hidden_state(server, model):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    texts = ["hello", "a longer input, of more tokens"]
    want = [_own_embedding(model, server.tokenizer.encode(t)) for t in texts]
    for fmt in ({}, {"encoding_format": "float"}):   # unless told, the client asks for base64 and decodes it
        reply = client.embeddings.create(model="tiny", input=texts, **fmt)
        assert [d.index for d in reply.data] == [0, 1]
        for d, w in zip(reply.data, want):
            torch.testing.assert_close(torch.tensor(d.embedding), w, rtol=1e-5, atol=1e-6)
        assert reply.usage.prompt_tokens == sum(len(server.tokenizer.encode(t)) for t in texts)
    raw = client.embeddings.create(model="tiny", input=texts[0], encoding_format="base64").data[0].embedding
    decoded = torch.from_numpy(np.frombuffer(base64.b64decode(raw), dtype="<f4").copy())
    torch.testing.assert_close(decoded, want[0], rtol=1e-5, atol=1e-6)
    by_ids = client.embeddings.create(model="tiny", input=[server.tokenizer.encode(texts[0])])
    torch.testing.assert_close(torch.tensor(by_ids.data[0].embedding), want[0], rtol=1e-5, atol=1e-6)
    r = http_post(server.url + "/api/embed", json={"model": "tiny", "input": texts})
    assert r.status_code == 200 and r.json()["prompt_eval_count"] == reply.usage.prompt_tokens
    for got, w in zip(r.json()["embeddings"], want):
        torch.testing.assert_close(torch.tensor(got), w, rtol=1e-5, atol=1e-6)
    r = http_post(server.url + "/api/embeddings", json={"model": "tiny", "prompt": texts[0]})
    torch.testing.assert_close(torch.tensor(r.json()["embedding"]), want[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("path,body,status,words", [
    ("/v1/embeddings", {"input": ""}, 400, "empty"),
    ("/v1/embeddings", {"input": "x", "encoding_format": "int8"}, 400, "is not float or base64"),
    ("/v1/embeddings", {"input": "x", "dimensions": 3}, 400, "leave dimensions out"),
    ("/v1/embeddings", {"model": "other", "input": "x"}, 404, "other"),
    ("/v1/embeddings", {"input": ["x"] * 300}, 400, "send at most 256"),
    ("/api/embed", {"model": "tiny", "input": [""]}, 400, "non-empty text"),
    ("/api/embed", {"model": "nope", "input": "x"}, 404, "not found"),
    ("/api/show", {}, 400, "model is missing"),
    ("/api/show", {"model": "nope"}, 404, "not found")])
def test_bad_requests_to_them_are_4xx(server, path, body, status, words):
    r = http_post(server.url + path, json=body)
    assert r.status_code == status and words in r.text, r.text


def test_metrics_count_what_was_served(server):
    def scrape() -> dict:
        from prometheus_client.parser import text_string_to_metric_families
        text = http_get(server.url + "/metrics").text
        return {(s.name, s.labels.get("finished_reason")): s.value for f in text_string_to_metric_families(text)
                for s in f.samples}
    before = scrape()
    for prompt in ("abc", "abcdef"):
        assert server.post({"prompt": prompt, "max_tokens": 5, "temperature": 0}).status_code == 200
    after = scrape()
    grew = {k: after[k] - before.get(k, 0.0) for k in after}
    assert grew[("bunsan_prompt_tokens_total", None)] == 3 + 6
    assert grew[("bunsan_generation_tokens_total", None)] == 10
    assert grew[("bunsan_request_success_total", "length")] == 2
    assert grew[("bunsan_time_to_first_token_seconds_count", None)] == 2
    assert grew[("bunsan_inter_token_latency_seconds_count", None)] == 8
    assert after[("bunsan_kv_cache_blocks_total", None)] == server.batcher.pool.usable
    assert after[("bunsan_num_requests_running", None)] == after[("bunsan_num_requests_waiting", None)] == 0
    assert after[("bunsan_kv_cache_blocks_used", None)] == 0            # every block back in the pool
    assert grew[("bunsan_engine_iterations_total", None)] >= 5           # one loop per token at least
    assert grew[("bunsan_engine_busy_seconds_total", None)] >= grew[("bunsan_engine_forward_seconds_total", None)] > 0


def test_metrics_show_the_blocks_a_running_request_holds(server, monkeypatch):
    """Scraped while a streamed request runs (its steps held after the first two, so it still runs): it is
    running and holds the blocks of its tokens so far."""
    import threading

    from prometheus_client.parser import text_string_to_metric_families
    forward, permits = server.batcher._forward, threading.Semaphore(0)

    def held(*a):
        assert permits.acquire(timeout=CEILING_S), "no permit: the test hung"
        return forward(*a)
    monkeypatch.setattr(server.batcher, "_forward", held)
    permits.release(2)                                                  # the prefill and one decoding step
    steps = server.batcher.steps
    try:
        with http_stream("POST", server.url + "/v1/completions",
                         json={"prompt": "a" * 40, "max_tokens": 32, "temperature": 0, "stream": True}) as r:
            lines = r.iter_lines()
            wait_for(lambda: server.batcher.steps == steps + 1, "its first decoding step", server.thread.is_alive)
            text = http_get(server.url + "/metrics").text
            seen = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
            permits.release(64)
            for _ in lines:
                pass
    finally:
        permits.release(64)
    assert seen["bunsan_num_requests_running"] == 1
    assert seen["bunsan_kv_cache_blocks_used"] >= -(-41 // server.batcher.pool.block_size)


def test_ollama_show_and_ps(server, model):
    show = http_post(server.url + "/api/show", json={"model": "tiny"}).json()
    assert show["model_info"]["llama.block_count"] == model.config.num_hidden_layers
    assert show["model_info"]["general.parameter_count"] == sum(p.numel() for p in model.parameters())
    assert "<|im_start|>" in show["template"] and "embedding" in show["capabilities"]
    ps = http_get(server.url + "/api/ps").json()["models"][0]
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    assert ps["name"] == "tiny" and ps["size"] == weights + server.batcher.cache.nbytes and ps["size_vram"] == 0
