"""`bunsan serve` and `bunsan generate` on transformers causal LMs that are not Llamas (Qwen2/3, Mistral, Gemma
2/3, Phi-3, GPT-2): the serving batcher (rows at their own positions in the paged KV cache, shared prefix
blocks taken from the prefix cache, sequences preempted when blocks run out, sliding window layers masked as
transformers masks them) gives the tokens transformers' own greedy `generate` gives,
and so do the commands in one process, over tensor-parallel ranks and under a device map that puts blocks on
disk."""

# The cases kept (architecture x precision x where the model runs), and why each is enough:
#   batcher, fp32 (preempted, prefix reused)   qwen2 qwen3 mistral gemma2 gemma3 phi3 gpt2: each its own forward
#   batcher, bf16 and fp16                      the same seven x both dtypes (softcap, learned positions, windows)
#   the head's rows                             bunsan's Llama, qwen2
#   `bunsan serve DIR`, in this process         qwen2 (one process; device map to disk): the command's own loading
#   --tp 2's serving forward on a pool's ranks  qwen2, qwen3 (q/k norms), gemma3 (sliding layers), phi3 (fused
#                                               qkv, gathered): each family's plan, by the command's load and split
#       (each was a `bunsan serve --tp 2` launched, and failed to start in time on a busy machine; the launch
#       itself, torchrun and rank 0's HTTP process, is test_serve.py's tensor-parallel test, on a Llama)
#   `bunsan generate DIR` on a pool's ranks     qwen2 --tp 2; qwen2 device map to disk (test_cli launches
#                                               `generate --tp 2`)

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

transformers = pytest.importorskip("transformers")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from chat_tokenizer import save_chat_tokenizer  # noqa: E402
from serve_harness import CEILING_S, Server, http_post, run_until_done, tp_serving_job  # noqa: E402
from serve_harness import one_torch_thread  # noqa: E402,F401  (autouse: torch on one thread here)

SMALL = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128)
IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _config(kind: str):
    # sliding windows shorter than the prompts plus their answers: the window's mask decides tokens
    return {"qwen2": lambda: transformers.Qwen2Config(**SMALL, tie_word_embeddings=True),
            "qwen3": lambda: transformers.Qwen3Config(**SMALL, head_dim=16),
            "mistral": lambda: transformers.MistralConfig(**SMALL, sliding_window=8),
            "gemma2": lambda: transformers.Gemma2Config(**SMALL, head_dim=16, sliding_window=8, **IDS),
            "gemma3": lambda: transformers.Gemma3TextConfig(**SMALL, head_dim=16, sliding_window=8, **IDS),
            "phi3": lambda: transformers.Phi3Config(**SMALL, **IDS),
            # packed experts, split by width under TP (tensor_parallel/hf_moe.py)
            "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**SMALL, head_dim=16, moe_intermediate_size=32,
                                                             num_experts=4, num_experts_per_tok=2, norm_topk_prob=True),
            "gpt2": lambda: transformers.GPT2Config(vocab_size=320, n_embd=64, n_layer=2, n_head=4, n_positions=128,
                                                    bos_token_id=0, eos_token_id=0)}[kind]()


def _greedy(hf, prompt: list[int], n: int) -> list[int]:
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _serve_in_process(model, prompts: list[list[int]], n: int, slots: int) -> list[list[int]]:
    from bunsan.serve.batcher import Batcher, Request
    # blocks of 4 tokens, fewer than two long sequences need at once: some wait preempted and are prefilled again
    batcher = Batcher(model, slots=slots, max_len=64, block_size=4, num_blocks=10)
    got = [[] for _ in prompts]
    finished = []
    for i, p in enumerate(prompts):
        batcher.submit(Request(p, n, emit=lambda t, i=i: got[i].append(t.id), finish=finished.append))
    run_until_done(batcher, finished, len(prompts))
    assert batcher.reused_tokens > 0              # the shared prefix's blocks were taken, not prefilled again
    assert batcher.preempted > 0
    return got


@pytest.mark.parametrize("kind", ["qwen2", "qwen3", "mistral", "gemma2", "gemma3", "phi3", "gpt2", "qwen3_moe"])
def test_the_batcher_gives_transformers_greedy_tokens(kind):
    from bunsan.serve.transformers_model import TransformersLM
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(_config(kind)).eval()
    shared = torch.randint(3, 320, (13,)).tolist()
    prompts = [torch.randint(3, 320, (n,)).tolist() for n in (5, 17, 3)] + [shared, shared + [7, 9, 11]]
    want = [_greedy(hf, p, 14) for p in prompts]
    assert _serve_in_process(TransformersLM(hf), prompts, 14, slots=2) == want


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("kind", ["qwen2", "qwen3", "mistral", "gemma2", "gemma3", "phi3", "gpt2"])
def test_16_bit_weights_serve_transformers_greedy_tokens(kind, dtype):
    """The weights and the KV cache in bf16 / fp16 (the sliding window, Gemma 2's eager softcap and GPT-2's
    learned positions among them): four prompts batched give the tokens of transformers' greedy `generate` on
    the same 16-bit model."""
    from bunsan.serve.batcher import Batcher, Request
    from bunsan.serve.transformers_model import TransformersLM
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(_config(kind)).eval().to(dtype)
    shared = torch.randint(3, 320, (9,)).tolist()
    prompts = [torch.randint(3, 320, (n,)).tolist() for n in (5, 12)] + [shared, shared + [7, 9]]
    want = [_greedy(hf, p, 10) for p in prompts]
    batcher = Batcher(TransformersLM(hf), slots=4, max_len=64, block_size=4)
    assert {k.dtype for k in batcher.cache.k} == {dtype}
    got, finished = [[] for _ in prompts], []
    for i, p in enumerate(prompts):
        batcher.submit(Request(p, 10, emit=lambda t, i=i: got[i].append(t.id), finish=finished.append))
    run_until_done(batcher, finished, len(prompts))
    assert got == want


def test_what_the_serving_forward_cannot_mask_is_refused():
    from bunsan.serve.transformers_model import TransformersLM
    chunked = transformers.AutoModelForCausalLM.from_config(transformers.Qwen2Config(**SMALL))
    chunked.config.layer_types = ["chunked_attention", "full_attention"]
    with pytest.raises(ValueError, match=r"layer types \['chunked_attention'\] are not served"):
        TransformersLM(chunked)
    flex = transformers.AutoModelForCausalLM.from_config(transformers.Qwen2Config(**SMALL))
    flex.config._attn_implementation = "flex_attention"
    with pytest.raises(ValueError, match="attn_implementation 'flex_attention'.*sdpa and eager"):
        TransformersLM(flex)


def _save_directory(folder, kind: str):
    torch.manual_seed(1)
    transformers.AutoModelForCausalLM.from_config(_config(kind)).save_pretrained(folder)
    save_chat_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """A Hugging Face directory per architecture, saved the first time a test asks for it."""
    made = {}

    def get(kind: str):
        if kind not in made:
            made[kind] = _save_directory(tmp_path_factory.mktemp(kind), kind)
        return made[kind]
    return get


@pytest.fixture(scope="module")
def qwen2_dir(hf_dirs):
    return hf_dirs("qwen2")


def _completions(url: str, prompts: list[list[int]], n: int) -> list[str]:
    with ThreadPoolExecutor(len(prompts)) as pool:
        replies = list(pool.map(lambda p: http_post(url + "/v1/completions", timeout=CEILING_S, json={
            "prompt": p, "max_tokens": n, "temperature": 0}), prompts))
    for r in replies:
        assert r.status_code == 200, r.text
    return [r.json()["choices"][0]["text"] for r in replies]


def _prompts_and_answers(folder) -> tuple[list[list[int]], list[str]]:
    """Three prompts of the directory's vocabulary and transformers' greedy text for each (10 tokens)."""
    from bunsan.training.data import load_tokenizer
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    tokenizer = load_tokenizer(str(folder / "tokenizer.json"))
    torch.manual_seed(2)
    prompts = [torch.randint(3, 300, (n,)).tolist() for n in (4, 9, 6)]
    return prompts, [tokenizer.decode(_greedy(hf, p, 10)) for p in prompts]


@pytest.mark.parametrize("spread", [[], ["--device-map", "sequential", "--max-memory", "cpu=250KB"]],
                         ids=["one-process", "device-map-disk"])
def test_serve_a_transformers_directory(qwen2_dir, spread):
    """Loaded by the command's own code (cli/serve.py's load_model, cache_size, serve_app) and served here."""
    prompts, want = _prompts_and_answers(qwen2_dir)
    server = Server.of_command("--checkpoint", qwen2_dir, "--slots", "2", "--context", "64", *spread)
    try:
        assert _completions(server.url, prompts, 10) == want
    finally:
        server.close()


@pytest.mark.parametrize("kind", ["qwen2", "qwen3", "gemma3", "phi3", "qwen3_moe"])
def test_serve_tp2_splits_each_family_by_its_own_plan(pools, hf_dirs, kind):
    """Qwen2, Qwen3's q/k norms, Gemma 3's sliding layers, Phi-3's fused qkv_proj, which its plan gathers
    (`colwise_gather_output`: every rank keeps every key/value head in its cache), and Qwen3-MoE's packed experts
    (every expert's width split), over two ranks."""
    folder = hf_dirs(kind)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    torch.manual_seed(2)
    prompts = [torch.randint(3, 300, (n,)).tolist() for n in (4, 9, 6)]
    # (a collective's timeout far past the pool's ceiling: a busy machine never trips it)
    argv = ["--checkpoint", folder, "--slots", "2", "--context", "64", "--tp", "2", "--timeout", CEILING_S]
    got = pools.run(2, tp_serving_job, argv, prompts, 10, timeout=CEILING_S)[0]
    assert got == [_greedy(hf, p, 10) for p in prompts]


@pytest.mark.parametrize("spread", [["--tp", "2"], ["--device-map", "sequential", "--max-memory", "cpu=150KB"]],
                         ids=["tp2", "device-map-disk"])
def test_generate_from_a_transformers_directory(pools, qwen2_dir, spread):
    """The command on a pool's ranks, as torchrun's workers run it (test_cli launches `generate --tp 2`)."""
    from bunsan.training.data import load_tokenizer
    hf = transformers.AutoModelForCausalLM.from_pretrained(qwen2_dir).eval()
    tokenizer = load_tokenizer(str(qwen2_dir / "tokenizer.json"))
    prompt = "def f(x):"
    want = prompt + tokenizer.decode(_greedy(hf, tokenizer.encode(prompt), 12))
    r = pools.cli(2 if "--tp" in spread else 1, ["generate", "--checkpoint", qwen2_dir, "--prompt", prompt,
                                                 "--max-new-tokens", "12", *spread], timeout=CEILING_S)[0]
    assert r.returncode == 0, r
    lines = r.stdout.splitlines()
    assert want in lines, r.stdout
    if "--device-map" in spread:
        assert lines[-1].startswith("device map:") and "disk" in lines[-1], r.stdout


def test_the_server_loads_a_transformers_directory_with_its_end_tokens(qwen2_dir, tmp_path):
    """generation_config.json's eos list is what serve stops at (test_template_families: at the end of turn)."""
    import shutil
    folder = tmp_path / "m"
    shutil.copytree(qwen2_dir, folder)
    eot = json.loads((folder / "tokenizer.json").read_text())["added_tokens"][0]["id"]
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [eot]}))
    from bunsan.cli.serve import load_model
    import argparse
    args = argparse.Namespace(checkpoint=str(folder), tokenizer=None, device_map=None, max_memory=None, slots=2,
                              context=None, dtype="fp32")
    model, tokenizer, name, context = load_model(args)
    assert type(model).__name__ == "TransformersLM" and context == 128 and name == "m"
    assert eot in tokenizer.stop_ids


@pytest.mark.parametrize("kind", ["bunsan", "qwen2"])
def test_the_head_computes_only_the_logits_the_batcher_reads(kind):
    """A prefill chunk's logits are read at its last token only (but when its prompt is echoed with
    log-probabilities): the head sees one row per sequence, never every prompt token, and the tokens still
    equal transformers' greedy ones."""
    from bunsan.models import Llama, LlamaConfig
    from bunsan.serve.batcher import Batcher, Request
    from bunsan.serve.transformers_model import TransformersLM
    torch.manual_seed(0)
    if kind == "bunsan":
        model = Llama(LlamaConfig(**{k: v for k, v in SMALL.items()})).eval()
        head, want = model.lm_head, None
    else:
        hf = transformers.AutoModelForCausalLM.from_config(_config("qwen2")).eval()
        model, head = TransformersLM(hf), hf.lm_head
    prompts = [torch.randint(3, 320, (n,)).tolist() for n in (23, 9, 30)]
    if kind == "qwen2":
        want = [_greedy(hf, p, 6) for p in prompts]
    rows = []
    handle = head.register_forward_pre_hook(lambda _m, args: rows.append(args[0].shape[1]))
    batcher = Batcher(model, slots=3, max_len=64, block_size=4)
    got, finished = [[] for _ in prompts], []
    for i, p in enumerate(prompts):
        batcher.submit(Request(p, 6, emit=lambda t, i=i: got[i].append(t.id), finish=finished.append))
    run_until_done(batcher, finished, len(prompts))
    handle.remove()
    assert rows and max(rows) <= len(prompts), rows
    if want is not None:
        assert got == want
