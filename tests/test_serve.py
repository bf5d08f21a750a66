"""`bunsan serve` on loopback: concurrent completions equal offline greedy generation, streaming, stop strings,
4xx answers for bad input, limits, and a clean shutdown."""

# Served in this process (serve_harness.Server) but for two --tp 2 tests (e2e): `bunsan serve --tp 2` launched as
# a user starts it (the suite's one --tp 2 launch; started with the module, its start-up overlapping the rest),
# and rank 0 idle past --timeout on a pool's ranks (real seconds of idle are its subject).

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from parity import tiny_model

httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")

from serve_harness import (CEILING_S, PROMPTS, Launched, Server, http_get, http_post,  # noqa: E402
                           http_stream, offline, selected, wait_for)
from serve_harness import one_torch_thread  # noqa: E402,F401  (autouse: torch on one thread here)


@pytest.fixture(scope="module")
def model():
    return tiny_model(0).eval()


@pytest.fixture(scope="module")
def server(model):
    s = Server(model, max_tokens=64, max_body_bytes=4096)
    yield s
    s.close()


def test_concurrent_requests_equal_offline_generation(server, model):
    want = [offline(model, server.tokenizer, p, 12 + i) for i, p in enumerate(PROMPTS)]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:       # more requests than slots: they queue and interleave
        replies = list(pool.map(lambda a: server.post({"prompt": a[1], "max_tokens": 12 + a[0], "temperature": 0}),
                                enumerate(PROMPTS)))
    for r, w in zip(replies, want):
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["choices"][0]["text"] == w
        assert body["choices"][0]["finish_reason"] == "length"
        assert body["usage"]["completion_tokens"] == body["usage"]["total_tokens"] - body["usage"]["prompt_tokens"]
    assert server.batcher.steps < sum(12 + i for i in range(len(PROMPTS)))   # decode steps were shared


def test_past_the_slots_requests_wait_and_are_all_answered_at_the_default_limits(server, model):
    """160 clients at once on 3 slots with the default --max-concurrent: every one is answered with the
    offline tokens, none refused (the limit was 64, so the 65th open request was a 429)."""
    want = {p: offline(model, server.tokenizer, p, 3) for p in PROMPTS}
    with ThreadPoolExecutor(160) as pool:
        replies = list(pool.map(lambda i: server.post({"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 3,
                                                       "temperature": 0}), range(160)))
    assert [r.status_code for r in replies] == [200] * 160
    assert [r.json()["choices"][0]["text"] for r in replies] == [want[PROMPTS[i % len(PROMPTS)]] for i in range(160)]


def test_streaming_sends_the_same_text_as_events(server, model):
    want = offline(model, server.tokenizer, PROMPTS[0], 20)
    chunks, done = [], False
    with http_stream("POST", server.url + "/v1/completions",
                     json={"prompt": PROMPTS[0], "max_tokens": 20, "temperature": 0, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            chunks.append(json.loads(line[6:]))
    assert done and len(chunks) > 2
    assert "".join(c["choices"][0]["text"] for c in chunks) == want
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_a_stop_string_ends_the_completion_before_it(server, model):
    full = offline(model, server.tokenizer, PROMPTS[1], 30)
    stop = full[10:13]
    r = server.post({"prompt": PROMPTS[1], "max_tokens": 30, "temperature": 0, "stop": [stop]}).json()
    assert r["choices"][0]["text"] == full[:full.index(stop)]
    assert r["choices"][0]["finish_reason"] == "stop"


def test_no_part_of_a_stop_string_is_ever_sent():
    """A stop string spread over tokens: its first characters wait until it is clear whether it completes."""
    from bunsan.training.data import load_tokenizer
    from bunsan.serve.text import TextStream
    tok = load_tokenizer(None)                        # one byte, one token: every stop string spans tokens
    t = TextStream(tok, ["\n\n"])
    assert "".join(t.add(i) for i in tok.encode("Hi\nthere\n\nmore")) == "Hi\nthere" and t.stopped
    t = TextStream(tok, ["XYZ"])
    assert "".join(t.add(i) for i in tok.encode("abXY")) + t.rest() == "abXY" and not t.stopped


def test_text_decodes_incrementally_and_keeps_multibyte_characters_whole():
    """Deltas add up to the whole text (characters spelled over several byte tokens included), and each token
    decodes only the ids since the last whole character: linear, not quadratic, work."""
    from bunsan.training.data import load_tokenizer
    from bunsan.serve.text import TextStream
    tok = load_tokenizer(None)
    decoded = [0]

    class Counting:
        def decode(self, ids):
            decoded[0] += len(ids)
            return tok.decode(ids)
    text = "naïve café — 東京 " * 40
    ids = tok.encode(text)
    t = TextStream(Counting(), ["STOP"])
    deltas = [t.add(i) for i in ids]
    assert "".join(deltas) + t.rest() == text and not t.stopped
    assert all("\ufffd" not in d for d in deltas)            # never half a character
    assert decoded[0] < 8 * len(ids) + 2 * len(ids)          # a few ids per token (+ rest's whole decode)
    t = TextStream(tok, ["東京"])
    assert "".join(t.add(i) for i in tok.encode("café 東京 more")) == "café " and t.stopped


def test_sampling_is_seeded(server):
    body = {"prompt": "x", "max_tokens": 16, "temperature": 0.9, "top_k": 40, "top_p": 0.9, "seed": 3}
    a, b = server.post(body).json(), server.post(body).json()
    assert a["choices"][0]["text"] == b["choices"][0]["text"]


@pytest.mark.parametrize("body,status,words", [
    ("not json", 400, "not JSON"),
    ({"max_tokens": 4}, 400, "prompt"),
    ({"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 65}, 400, "limit of 64"),
    ({"prompt": "x" * 90, "max_tokens": 10}, 400, "context of 96"),
    ({"prompt": "x" * 5000}, 413, "exceeds the limit"),
])
def test_bad_input_gets_a_4xx_with_the_reason(server, body, status, words):
    r = (http_post(server.url + "/v1/completions", content=body) if isinstance(body, str)
         else server.post(body))
    assert r.status_code == status
    assert words in r.json()["error"]["message"]


def test_a_bad_request_among_good_ones_disturbs_nothing(server, model):
    want = offline(model, server.tokenizer, PROMPTS[2], 10)
    bodies = [{"prompt": PROMPTS[2], "max_tokens": 10, "temperature": 0}, {"prompt": 7},
              {"prompt": PROMPTS[2], "max_tokens": 10, "temperature": 0}]
    with ThreadPoolExecutor(3) as pool:
        good, bad, again = pool.map(server.post, bodies)
    assert bad.status_code == 400
    assert good.json()["choices"][0]["text"] == want == again.json()["choices"][0]["text"]


def test_a_client_that_does_not_read_blocks_no_one(server, model):
    """A streaming client that never reads its events: the others are answered all the same."""
    want = offline(model, server.tokenizer, PROMPTS[4], 12)
    with http_stream("POST", server.url + "/v1/completions",
                     json={"prompt": PROMPTS[3], "max_tokens": 60, "stream": True, "temperature": 0}) as idle:
        assert idle.status_code == 200                     # opened, then left unread
        with ThreadPoolExecutor(3) as pool:
            replies = list(pool.map(server.post, [{"prompt": PROMPTS[4], "max_tokens": 12, "temperature": 0}] * 3))
        assert [r.json()["choices"][0]["text"] for r in replies] == [want] * 3


def test_health(server):
    h = http_get(server.url + "/health").json()
    assert h["status"] == "ok" and h["slots"] == 3 and h["context"] == 96


def test_concurrency_limit_and_shutdown():
    gate = threading.Event()
    held = tiny_model(0).eval()
    held.register_forward_pre_hook(lambda m, a: None if gate.wait(CEILING_S) else None)   # until let
    s = Server(held, slots=1, context=96, max_concurrent=1, max_tokens=64)
    try:
        with ThreadPoolExecutor(1) as pool:
            first = pool.submit(s.post, {"prompt": "a", "max_tokens": 4, "temperature": 0})
            wait_for(lambda: sum(s.batcher.load()) > 0, "the first request reaching the batcher",
                     lambda: not first.done())
            busy = s.post({"prompt": "b", "max_tokens": 4})
            gate.set()
            assert busy.status_code == 429 and "retry" in busy.json()["error"]["message"]
            assert first.result().status_code == 200
    finally:
        gate.set()
        s.close()
    assert not s.thread.is_alive() and s.batcher.stopped      # uvicorn and the batcher both ended


def test_serve_refuses_what_it_cannot_do(tmp_path, capsys):
    from bunsan.cli.main import main
    assert main(["serve", "--checkpoint", str(tmp_path), "--tp", "2", "--device-map", "auto"]) == 2
    assert "--tp and --device-map both spread the model: use one" in capsys.readouterr().err
    assert main(["serve", "--checkpoint", str(tmp_path), "--slots", "0"]) == 2
    assert "--slots 0 must be at least 1" in capsys.readouterr().err


def test_the_command_loads_hf_and_trained_checkpoints(tmp_path, model):
    import argparse

    from bunsan.cli.serve import load_model
    from bunsan.inference import placed as placement
    from bunsan.models.hf import save_llama
    save_llama(model.state_dict(), model.config, tmp_path / "hf")
    args = argparse.Namespace(checkpoint=str(tmp_path / "hf"), tokenizer=None, device_map=None, max_memory=None,
                              slots=2, context=None, dtype="fp32")
    loaded, tokenizer, name, context = load_model(args)
    assert name == "hf" and context == model.config.max_position_embeddings
    for (k, v), w in zip(loaded.state_dict().items(), model.state_dict().values()):
        assert torch.equal(v, w), k
    args.device_map, args.context = "sequential", 64          # spread over CPU (and disk, had it a budget)
    placed, _, _, context = load_model(args)
    assert context == 64 and placement(placed).memory_estimate.max_seq == 64
    args.context = 10_000
    with pytest.raises(ValueError, match="--context 10000 must be in 2.."):
        load_model(args)


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def _rank_of(pid: int) -> int | None:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    ranks = [e for e in env if e.startswith(b"RANK=")]
    return int(ranks[0][5:]) if ranks else None


@pytest.fixture(scope="module", autouse=True)
def tp_server(request, tmp_path_factory, model):
    """The `bunsan serve --tp 2` server, launched as the module starts when its test is to run: its start-up
    (torchrun, two ranks, rank 0's HTTP process: a minute or more on a busy machine) overlaps the tests served
    in this process. Its --timeout stays the default: it also bounds the ranks' meeting at start-up, which a
    busy machine delays by seconds."""
    if not selected(request, "test_tensor_parallel_serving_and_a_dead_rank"):
        yield None
        return
    import os

    from bunsan.models.hf import save_llama
    folder = tmp_path_factory.mktemp("hf")
    save_llama(model.state_dict(), model.config, folder)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "OMP_NUM_THREADS": "1"}
    server = Launched("--checkpoint", folder, "--tp", "2", "--slots", "2", "--context", "96", env=env, wait=False,
                      what="the tensor-parallel server")
    yield server
    server.close(kill=True)


@pytest.mark.e2e
def test_tensor_parallel_serving_and_a_dead_rank(tp_server, model):
    """--tp 2: rank 0 serves, both ranks run every forward; outputs equal one process's; a killed follower ends
    serving with errors, never a hang. (The `bunsan serve --tp 2` launch the suite keeps: torchrun's ranks,
    rank 0's HTTP process.)"""
    import os
    import signal

    from bunsan.training.data import load_tokenizer
    server = tp_server.ready()
    url = server.url
    try:
        tok = load_tokenizer(None)
        want = [offline(model, tok, p, 10) for p in PROMPTS[:3]]
        with ThreadPoolExecutor(3) as pool:
            replies = list(pool.map(lambda p: http_post(url + "/v1/completions", timeout=CEILING_S, json={
                "prompt": p, "max_tokens": 10, "temperature": 0}), PROMPTS[:3]))
        assert [r.json()["choices"][0]["text"] for r in replies] == want, server.output()
        follower = [c for w in _children(server.proc.pid) for c in [w, *_children(w)] if _rank_of(c) == 1]
        assert follower, "rank 1's process not found"
        os.kill(follower[0], signal.SIGKILL)
        try:
            r = http_post(url + "/v1/completions", timeout=CEILING_S, json={"prompt": "a", "max_tokens": 10})
            assert r.status_code >= 500, r.text
        except httpx.TransportError:
            pass                                        # the server was already going down: also not a hang
        assert server.proc.wait(timeout=CEILING_S) != 0, server.output()
    finally:
        server.close(kill=True)


@pytest.mark.e2e          # (seconds of real idle are its subject: it cannot be quick)
def test_tensor_parallel_ranks_idle_past_the_collective_timeout_stay_joined(pools, tmp_path, model):
    """Rank 0 idle longer than --timeout (6 s) before any request: its heartbeats keep rank 1 following, and the
    prompts then give one process's tokens. On a pool's ranks (their group made already: the timeout bounds
    only the collectives, the subject, not the ranks' meeting)."""
    from bunsan.models import generate
    from bunsan.models.hf import save_llama
    from serve_harness import tp_serving_job
    save_llama(model.state_dict(), model.config, tmp_path / "hf")
    prompts = [[5, 6, 7], [9] * 12, [11, 3]]
    argv = ["--checkpoint", tmp_path / "hf", "--tp", "2", "--slots", "2", "--context", "96", "--timeout", "6"]
    got = pools.run(2, tp_serving_job, argv, prompts, 10, 7.0, timeout=CEILING_S)[0]
    assert got == [generate(model, torch.tensor([p]), 10)[0, len(p):].tolist() for p in prompts]


def test_the_kv_cache_size_follows_its_budget_and_is_printed(model):
    import argparse

    from bunsan.cli.serve import cache_size
    from bunsan.serve import PagedCache
    from bunsan.serve.paged import block_bytes
    per_block = block_bytes(model.config, 16, None, torch.float32)
    assert per_block * 5 == PagedCache(model, 5, 16).nbytes
    args = argparse.Namespace(slots="auto", kv_cache_memory=str(40 * per_block + 5), max_concurrent=1024,
                              block_size=16)
    slots, blocks, line = cache_size(args, model, 96, None)
    assert (slots, blocks) == (256, 40)         # 256 sequences share 39 blocks: as many as their lengths allow
    args.max_concurrent = 64
    assert cache_size(args, model, 96, None)[0] == 64      # never more places than may be open
    assert line.startswith("KV cache 39 blocks x 16 tokens = 624 tokens, ") and "--kv-cache-memory" in line
    args.kv_cache_memory, args.slots = None, 3  # no budget: at most every sequence at the full context
    assert cache_size(args, model, 96, None)[:2] == (3, 1 + 3 * 6)
    args.kv_cache_memory = str(3 * per_block)
    with pytest.raises(ValueError, match="does not hold one request of --context 96 tokens"):
        cache_size(args, model, 96, None)


def test_a_cpu_served_model_leaves_a_core_to_the_event_loop(monkeypatch):
    import os

    from bunsan.serve.server import cpu_threads
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    assert cpu_threads() == 3 and cpu_threads(4) == 4
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)
    assert cpu_threads() == 1
    with pytest.raises(ValueError, match="--threads 0 must be at least 1"):
        cpu_threads(0)


def test_rows_drawn_together_are_each_rows_own_draw():
    """draw_rows' one argmax over the greedy rows (a logit bias among them) and its row-by-row draws for the
    others pick what each request's own draw picks."""
    import copy

    from bunsan.serve.sampling import RowSampler, SamplingParams, draw_rows
    from bunsan.serve.sequence import Request
    vocab = 50
    prompt = [1, 2, 3]
    kinds = [SamplingParams(), SamplingParams(logit_bias={7: 30.0, 9: -5.0}), None,
             SamplingParams(temperature=0.8, seed=3), SamplingParams(repetition_penalty=1.5),
             SamplingParams(frequency_penalty=1.0, presence_penalty=0.5, logit_bias={4: 2.0}),
             SamplingParams(logprobs=2), SamplingParams(logit_bias={11: 1.0})]
    made = [Request(prompt, 4, emit=None, finish=None,
                    sampler=None if k is None else RowSampler(k, prompt, vocab)) for k in kinds]
    alone = copy.deepcopy(made)
    torch.manual_seed(0)
    for _ in range(4):
        logits = torch.randn(len(made), vocab)
        together = draw_rows(made, logits)
        one_by_one = [r.draw(logits[j]) for j, r in enumerate(alone)]
        assert [t.id for t in together] == [t.id for t in one_by_one]
        assert together[6].logprob == one_by_one[6].logprob
        assert together[1].id == 7                     # the bias decided it
