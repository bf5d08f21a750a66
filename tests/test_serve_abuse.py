"""Nothing a client sends breaks or stalls `bunsan serve`: hundreds of malformed requests are 4xx in OpenAI's
error shape and the server then answers as before; a body that never finishes, a client that leaves while
uploading or while its answer is generated, stop strings past the limits; admission of waiting requests in
one batched prefill; a bounded shutdown."""

# Every server here is in this process. Where a test shows that something does not wait (a stalled body, a
# client gone, a shutdown), the model's steps are let through one by one and the cause is waited for, never a
# number of seconds. The two keep-alive tests idle real seconds (their subject): the e2e tier.

from __future__ import annotations

import json
import logging
import random
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from parity import tiny_model

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from serve_harness import CEILING_S, PROMPTS, Server, http_get, http_post, http_stream, offline, wait_for  # noqa: E402
from serve_harness import one_torch_thread  # noqa: E402,F401  (autouse: torch on one thread here)

GOOD = {"prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def model():
    return tiny_model(0).eval()


@pytest.fixture(scope="module")
def server(model):
    s = Server(model, slots=3, context=96, max_tokens=64, max_body_bytes=64 << 10, body_timeout_s=1.0)
    yield s
    s.close()


def _with(base: dict, **fields) -> dict:
    return {**base, **fields}


def malformed_bodies(rng: random.Random) -> list[tuple[str, bytes]]:
    """(path, body) of requests a client should get a 4xx for: every class the issue names, and more."""
    bad_values = {
        "max_tokens": ["10", 10.0, True, -1, 0, 65, 10 ** 30, [1], {"a": 1}],
        "temperature": ["hot", True, -0.1, 10.5, [0.5], {"t": 1}],
        "top_p": [0, 0.0, 1.5, -1, "0.9", False],
        "top_k": [-2, 2.5, "40", True],
        "seed": [2 ** 63, -(2 ** 63) - 1, 2 ** 64, 10 ** 40, "1", 1.5, True],
        "stream": ["yes", 1, "true", [True]],
        "n": [0, 17, "2", 1.0, True],
        "best_of": [0, 1 << 20, "3"],
        "logprobs": [-1, 21, "5", True],
        "echo": ["no", 0],
        "stop": [7, [1, 2], ["x"] * 17, "y" * 257, ["ok", "z" * 300], {"s": 1}, ["\ud800"]],
        "presence_penalty": [3, -2.5, "1"], "frequency_penalty": [2.1, "0"], "repetition_penalty": [0, -1, 11],
        "logit_bias": [{"x": 1}, {"999": 1}, {"1": 101}, [1, 2], {"1": "5"}],
        "stream_options": [{"include_usage": "yes"}, {"other": True}, "usage"],
        "min_p": [-0.1, 1.1],
        "prompt": ["", [], [""], [-1], [256], [[]], [[1, "a"]], [True], 7, None, {"p": "x"}, [1, [2]], "\ud800"],
        "model": ["gpt-4", 7, ""],
        "suffix": ["tail"], "tools": [[{"type": "function"}]],
        "response_format": [{"type": "xml"}, "json", {"type": "json_schema"},
                            {"type": "json_schema", "json_schema": 5}],
        "guided_regex": ["(", 5], "guided_choice": [[], "a", [1]], "structured_outputs": [{"json": 5}, {"nope": "x"}],
        "unknown_field": [1, "x"],
    }
    out = []
    for name, values in bad_values.items():
        for v in values:
            body = _with(GOOD, **{name: v})
            if name == "best_of":
                body["n"] = 2
            out.append(("/v1/completions", json.dumps(body).encode()))
    chat_bad = [{"messages": []}, {"messages": "hi"}, {"messages": [{"role": "tool", "content": "x"}]},
                {"messages": [{"role": "user", "content": 7}]}, {"messages": [{"content": "x"}]},
                {"messages": [{"role": "user", "content": [{"type": "image_url", "text": "u"}]}]},
                _with(CHAT, top_logprobs=2), _with(CHAT, max_tokens=3, max_completion_tokens=4),
                _with(CHAT, logprobs="yes"), _with(CHAT, tool_choice="auto"), _with(CHAT, max_completion_tokens=0),
                {"messages": [{"role": "user", "content": "x" * 200}]}]
    out += [("/v1/chat/completions", json.dumps(b).encode()) for b in chat_bad]
    good = json.dumps(GOOD).encode()
    for _ in range(50):                   # bytes that are not UTF-8, somewhere in an otherwise good body
        at = rng.randrange(1, len(good) - 1)
        out.append(("/v1/completions", good[:at] + bytes([rng.choice([0x80, 0xc3, 0xff, 0xfe, 0xed])]) + good[at:]))
    for _ in range(30):                   # cut anywhere: not JSON
        out.append(("/v1/completions", good[:rng.randrange(0, len(good) - 1)]))
    out += [("/v1/completions", b"[" * d + b"]" * d) for d in (40, 1000, 20000)]           # deep nesting
    out += [("/v1/completions", b'{"prompt": ' + b"[" * d + b"]" * d + b"}") for d in (33, 5000)]
    out += [("/v1/completions", x) for x in (b"", b"null", b"[]", b'"prompt"', b"17", b'{"prompt": NaN}',
                                             b'{"prompt": "x", "temperature": Infinity}', b"1" * 5000,
                                             b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}",
                                             b'{"prompt": "x", "prompt": 5}', b"\xef\xbb\xbf{}")]
    out += [("/v1/completions", json.dumps(_with(GOOD, prompt="x" * 90, max_tokens=10)).encode())]
    return out


def _shape_ok(r) -> bool:
    body = r.json()
    return set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"} and \
        isinstance(body["error"]["message"], str) and body["error"]["message"]


def test_fuzz_malformed_requests_get_4xx_and_change_nothing(server, model):
    want = offline(model, server.tokenizer, GOOD["prompt"], GOOD["max_tokens"])
    assert server.post(GOOD).json()["choices"][0]["text"] == want
    bodies = malformed_bodies(random.Random(0))
    assert len(bodies) >= 200

    def send(item):
        path, body = item
        return item, http_post(server.url + path, content=body, timeout=CEILING_S,
                               headers={"content-type": "application/json"})
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(send, bodies))
    wrong = [(item, r.status_code, r.text[:200]) for item, r in answers
             if not (400 <= r.status_code < 500 and _shape_ok(r))]
    assert not wrong, wrong[:5]
    assert {r.status_code for _, r in answers} <= {400, 404, 413}
    assert server.post(GOOD).json()["choices"][0]["text"] == want
    assert http_get(server.url + "/nowhere").json()["error"]["code"] == "404"
    assert http_get(server.url + "/v1/completions").status_code == 405


def test_a_tiny_temperature_is_greedy_and_top_k_0_is_off(server):
    greedy = server.post(GOOD).json()["choices"][0]["text"]
    for extra in ({"temperature": 1e-45}, {"temperature": 1e-6, "top_k": 0}, {"temperature": 0, "top_k": -1}):
        r = server.post(_with(GOOD, **extra))
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == greedy, extra


def _raw(server, head: bytes, body: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=CEILING_S)
    sock.sendall(head + body)
    return sock


def _post_head(length: int) -> bytes:
    return (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: " + str(length).encode() + b"\r\n\r\n")


def _quiet(server) -> bool:
    """No connection open and no request task running in uvicorn: everything sent so far was handled."""
    state = server.server.server_state
    return not state.connections and not state.tasks


def test_a_body_shorter_than_its_content_length_times_out_and_stalls_no_one(server, model):
    """The server's body timeout (1 s, its configuration) answers it 408 for that cause; the other clients
    sending meanwhile are answered as usual."""
    want = offline(model, server.tokenizer, PROMPTS[2], 10)
    sock = _raw(server, _post_head(1000), b'{"prompt": "a"')
    try:
        with ThreadPoolExecutor(3) as pool:
            texts = [r.json()["choices"][0]["text"] for r in pool.map(server.post, [_with(
                GOOD, prompt=PROMPTS[2], max_tokens=10)] * 3)]
        assert texts == [want] * 3
        reply = b""
        while b"}}" not in reply and (chunk := sock.recv(65536)):
            reply += chunk
        reply = reply.decode()
        assert reply.startswith("HTTP/1.1 408"), reply
        assert "not received within 1 s" in reply
    finally:
        sock.close()


def test_a_client_leaving_mid_upload_is_quiet(server, caplog):
    with caplog.at_level(logging.ERROR):
        for _ in range(3):
            _raw(server, _post_head(500), b'{"prompt": ').close()
        wait_for(lambda: _quiet(server), "uvicorn done with the three connections", server.thread.is_alive)
        assert server.post(GOOD).status_code == 200
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


def test_stop_strings_past_the_limits_are_refused(server):
    for stop in (["x"] * 17, "s" * 300_000, ["ok", "y" * 257]):
        r = server.post(_with(GOOD, stop=stop))
        assert r.status_code in (400, 413) and r.json()["error"]["param"] in ("stop", None)
    many = ["".join(random.Random(i).choices("abcdefgh", k=256)) for i in range(16)]   # the most allowed
    assert server.post(_with(GOOD, stop=many)).status_code == 200


def test_a_non_streaming_client_that_leaves_frees_its_slot_at_once(model):
    """The model's steps let through one at a time: the client leaves while a step is held; the disconnect
    cancels its sequence, which gives its slot back at the next step (the held one's at most), not after its
    60 tokens."""
    held = tiny_model(0).eval()
    permits = threading.Semaphore(0)
    held.register_forward_pre_hook(lambda m, a: None if permits.acquire(timeout=CEILING_S) else None)
    s = Server(held, slots=1, context=96, max_tokens=64)
    body = json.dumps(_with(GOOD, max_tokens=60)).encode()
    try:
        for _ in range(3):                      # the prefill and two decoding steps; the fourth waits
            permits.release()
        sock = _raw(s, _post_head(len(body)), body)
        wait_for(lambda: s.batcher.steps == 2, "two decoding steps", s.thread.is_alive)
        sock.close()
        running = lambda: [q.request for q in s.batcher.running + s.batcher.prefilling]    # noqa: E731
        wait_for(lambda: all(r.cancelled for r in running()), "the disconnect cancelling the sequence",
                 s.thread.is_alive)
        for _ in range(60):
            permits.release()
        wait_for(lambda: s.batcher.load() == (0, 0), "its slot given back", s.thread.is_alive)
        assert s.batcher.steps <= 3, s.batcher.steps            # the held step at most, not its 60 tokens
    finally:
        for _ in range(64):
            permits.release()
        s.close()


def test_a_request_the_kv_pool_could_never_hold_is_a_400_and_frees_its_count(model):
    """Within the context but past the pool (4 blocks of 16 tokens): a 400 naming the blocks, n=2 included, and
    the open count given back (a later request is not refused as too many)."""
    s = Server(model, slots=2, context=96, num_blocks=5, max_concurrent=2)
    try:
        for n in (1, 2):
            r = s.post({**GOOD, "max_tokens": 70, "n": n})
            assert r.status_code == 400 and "KV blocks" in r.json()["error"]["message"], r.text
        assert s.app.state.service.open_sequences == 0
        assert s.post({**GOOD, "n": 2}).status_code == 200
    finally:
        s.close()


def test_waiting_requests_are_admitted_together_in_one_prefill(model):
    """Six prompts of different lengths waiting for six slots: one prefill forward for all, their tokens
    flattened into one row without padding, greedy output equal to one process's."""
    from bunsan.serve import Batcher, Request
    from bunsan.training.data import load_tokenizer
    tok = load_tokenizer(None)
    shapes = []
    hook = model.register_forward_pre_hook(lambda m, a: shapes.append(tuple(a[0].shape)))
    try:
        b = Batcher(model, 6, 96)
        outs = {i: [] for i in range(6)}
        done = threading.Event()
        ended = []
        for i, p in enumerate(PROMPTS[:6]):
            b.submit(Request(ids=tok.encode(p), max_tokens=8, emit=lambda t, i=i: outs[i].append(t.id),
                             finish=lambda reason: (ended.append(reason), len(ended) == 6 and done.set())))
        worker = threading.Thread(target=b.run, daemon=True)
        worker.start()
        assert done.wait(CEILING_S)
        b.stop()
        worker.join(10)
    finally:
        hook.remove()
    assert shapes[0] == (1, sum(len(tok.encode(p)) for p in PROMPTS[:6])) and len(shapes) == 8
    assert [tok.decode(outs[i]) for i in range(6)] == [offline(model, tok, p, 8) for p in PROMPTS[:6]]


def test_shutdown_answers_running_requests_with_an_error_within_the_grace(model):
    """A stream whose next step is held until the drain has given up on it (its grace, 0.5 s, is the server's
    configuration): the shutdown does not wait for it; it is answered with the "shutting down" error and
    [DONE], and the server ends."""
    import signal
    held = tiny_model(0).eval()
    permits = threading.Semaphore(0)
    held.register_forward_pre_hook(lambda m, a: None if permits.acquire(timeout=CEILING_S) else None)
    s = Server(held, slots=2, context=96, max_tokens=64, grace_s=0.5)
    events = []

    def stream():
        with http_stream("POST", s.url + "/v1/completions", timeout=CEILING_S,
                         json=_with(GOOD, max_tokens=60, stream=True)) as r:
            events.extend(line for line in r.iter_lines() if line.startswith("data: "))
    reader = threading.Thread(target=stream)
    try:
        for _ in range(2):                      # the prefill and one decoding step; the next waits
            permits.release()
        reader.start()
        wait_for(lambda: s.batcher.steps == 1, "the stream's first decoding step", reader.is_alive)
        s.server.handle_exit(signal.SIGTERM, None)
        wait_for(lambda: s.batcher.stopped, "the drain giving up on the stream after its grace", s.thread.is_alive)
    finally:
        for _ in range(64):
            permits.release()
    reader.join(CEILING_S)
    s.thread.join(CEILING_S)
    assert not s.thread.is_alive() and not reader.is_alive()
    assert events[-1] == "data: [DONE]" and "shutting down" in events[-2], events[-3:]
    assert json.loads(events[-2][6:])["error"]["code"] is None
    assert len(events) < 60                     # it never ran to its 60 tokens


@pytest.mark.e2e          # (seconds of real idle are its subject: it cannot be quick)
def test_every_keep_alive_client_gets_an_answer_at_96_at_once(model):
    """96 streaming clients on keep-alive connections (the openai client, no retries), each reusing its
    connection after an idle pause around 5 s (uvicorn's default idle close, and httpx's pool expiry): every
    request is answered. (A guard: the drop once seen at 64 clients did not reproduce here, with the old or
    the new keep-alive timeout.)"""
    openai = pytest.importorskip("openai")
    s = Server(model, slots=32, context=96, max_tokens=16, max_concurrent=256)
    client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=CEILING_S)
    failures = []

    def two(i: int) -> int:
        got = 0
        for k in range(2):
            try:
                stream = client.completions.create(model="tiny", prompt=PROMPTS[i % len(PROMPTS)], max_tokens=8,
                                                   stream=True, temperature=0)
                got += sum(1 for chunk in stream if chunk.choices and chunk.choices[0].finish_reason)
            except Exception as e:        # noqa: BLE001  (any failure is what this test counts)
                failures.append(f"client {i} request {k}: {e!r}"[:200])
            if k == 0:
                time.sleep(4.95 + i * 0.002)         # idle across 5 s
        return got
    try:
        with ThreadPoolExecutor(96) as pool:
            ended = list(pool.map(two, range(96)))
    finally:
        s.close()
    assert not failures, failures[:5]
    assert ended == [2] * 96


@pytest.mark.e2e          # (seconds of real idle are its subject: it cannot be quick)
def test_a_connection_idle_past_the_clients_expiry_is_still_answered(model):
    """The keep-alive race, made deterministic: a client's idle clock starts when it has read the answer, the
    server's when it sent it, so under load (64 streaming clients on 2 cores) a client reusing a connection it
    has kept 3-5 s (httpx's, so openai's, pool expiry is 5 s) can reach a server that has kept it idle past 5 s,
    uvicorn's default, and is closing it: the request is sent into the closing socket and never answered (the
    ReadError('') once seen at 64 clients). Here the client lags the server by the most any pool expiry of 5 s
    allows plus a margin: a raw keep-alive connection, idle 5.5 s, must still be answered."""
    s = Server(model, slots=2, context=96, max_tokens=16)
    body = json.dumps(_with(GOOD, max_tokens=2)).encode()
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)

    def answer(sock) -> bytes:
        data = b""
        while b"\r\n\r\n" not in data or len(data.partition(b"\r\n\r\n")[2]) < _length(data):
            chunk = sock.recv(65536)
            if not chunk:
                return data
            data += chunk
        return data
    try:
        with socket.create_connection(("127.0.0.1", s.port), timeout=CEILING_S) as sock:
            sock.sendall(request)
            assert answer(sock).startswith(b"HTTP/1.1 200")
            time.sleep(5.5)
            sock.sendall(request)
            assert answer(sock).startswith(b"HTTP/1.1 200"), "the idle connection was closed unanswered"
    finally:
        s.close()


def _length(head: bytes) -> int:
    for line in head.partition(b"\r\n\r\n")[0].split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 0
