"""Many LoRA adapters on one served base (serve/lora.py): requests naming different adapters run in the same
batches, each giving the greedy tokens of its own merged model (peft's merge_and_unload for a Qwen2 base;
bunsan's merge for its Llama), the prefix cache kept apart per adapter; `--lora-modules` and vLLM's runtime
load/unload endpoints over HTTP."""

# Over HTTP twice, the same checks: loaded by the command's own code and served in this process; and `bunsan
# serve --lora-modules` launched as a user starts it (e2e, the LoRA launch path: adapters in the model's process).

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from parity import tiny_model  # noqa: E402
from serve_harness import Launched, Server, http_get, http_post, run_until_done  # noqa: E402
from serve_harness import one_torch_thread  # noqa: E402,F401  (autouse: torch on one thread here)

SMALL = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128)


def _adapter(base, folder, seed: int, targets, r: int = 4):
    """A peft adapter of `base` with random (non-zero) A and B, saved to `folder`; its merged model."""
    torch.manual_seed(seed)
    tuned = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets))
    for name, p in tuned.named_parameters():
        if "lora_" in name:
            p.data.normal_(0, 0.3)
    tuned.save_pretrained(folder)
    return tuned.merge_and_unload().eval()


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_config(transformers.Qwen2Config(**SMALL)).eval()
    root = tmp_path_factory.mktemp("adapters")
    merged = {"a": _adapter(base, root / "a", 1, ["q_proj", "v_proj"]),
              "b": _adapter(base, root / "b", 2, ["o_proj", "down_proj", "up_proj"], r=8)}
    return base, root, merged


def _greedy(model, prompt, n):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _run(batcher, work: list[tuple[list[int], int, int]], n: int) -> list[list[int]]:
    from bunsan.serve.batcher import Request
    got, ended = [[] for _ in work], []
    for i, (ids, slot, root) in enumerate(work):
        batcher.submit(Request(ids, n, emit=lambda t, i=i: got[i].append(t.id), finish=ended.append, adapter=slot,
                               root=root))
    run_until_done(batcher, ended, len(work))
    return got


def test_rows_of_different_adapters_batched_together_give_their_merged_models_tokens(qwen):
    from bunsan.serve.batcher import Batcher
    from bunsan.serve.lora import AdapterSet
    from bunsan.serve.transformers_model import TransformersLM
    base, root, merged = qwen
    served = TransformersLM(copy.deepcopy(base))
    adapters = AdapterSet(served, capacity=2, max_rank=8)
    adapters.add("a", str(root / "a"))
    adapters.add("b", str(root / "b"))
    torch.manual_seed(3)
    shared = torch.randint(3, 300, (12,)).tolist()        # three whole blocks of 4: cached, per adapter
    work, want = [], []
    for name in ("a", None, "b", "a", "b", None):
        slot, root_id = (adapters.slots[name], adapters.roots[name]) if name else (0, 0)
        work.append((shared + torch.randint(3, 300, (3,)).tolist(), slot, root_id))
        want.append(_greedy(merged[name] if name else base, work[-1][0], 10))
    batcher = Batcher(served, slots=6, max_len=64, block_size=4, adapters=adapters)
    assert _run(batcher, work, 10) == want
    assert batcher.reused_tokens > 0                       # the shared prefix's blocks, reused within each chain


def test_bunsan_llama_serves_its_own_adapter_format(tmp_path):
    """An adapter in bunsan train's layout (peft's names, bunsan's Llama underneath) equals the merged weights."""
    from bunsan.checkpoint.adapter import merged_with_base
    from bunsan.models.generate import generate
    from bunsan.serve.batcher import Batcher
    from bunsan.serve.lora import AdapterSet
    from safetensors.torch import save_file
    import json
    model = tiny_model(0).eval()
    torch.manual_seed(5)
    h, r = model.config.hidden_size, 4
    tensors = {f"base_model.model.model.layers.{i}.self_attn.q_proj.lora_{p}.weight":
               torch.randn((r, h) if p == "A" else (h, r)) * 0.3 for i in range(2) for p in "AB"}
    (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": r, "lora_alpha": 8}))
    save_file(tensors, str(tmp_path / "adapter_model.safetensors"))
    merged = tiny_model(0).eval()
    merged.load_state_dict(merged_with_base(tmp_path, model.state_dict(), True))
    adapters = AdapterSet(model, capacity=1, max_rank=4)
    adapters.add("mine", str(tmp_path))
    prompt = torch.randint(0, 200, (9,)).tolist()
    want = [generate(merged, torch.tensor([prompt]), 8)[0, 9:].tolist(),
            generate(tiny_model(0).eval(), torch.tensor([prompt]), 8)[0, 9:].tolist()]
    assert want[0] != want[1]
    batcher = Batcher(model, slots=2, max_len=64, adapters=adapters)
    assert _run(batcher, [(prompt, 1, adapters.roots["mine"]), (prompt, 0, 0)], 8) == want


@pytest.fixture(scope="module")
def base_dir(qwen, tmp_path_factory):
    """The Qwen2 base saved as a Hugging Face directory with a tokenizer of its 320 tokens (not bytes)."""
    from chat_tokenizer import save_chat_tokenizer
    folder = tmp_path_factory.mktemp("served") / "base"       # (served as "base": its folder's name)
    qwen[0].save_pretrained(folder)
    save_chat_tokenizer(folder)
    return folder


def _lora_flags(base_dir, root) -> list:
    return ["--checkpoint", base_dir, "--context", "64", "--max-tokens", "16", "--lora-modules", f"a={root / 'a'}",
            "--allow-runtime-lora", "--max-loras", "2", "--max-lora-rank", "8"]


def test_adapters_by_name_over_http_and_loaded_at_run_time(qwen, base_dir):
    """Loaded by the command's own code (cli/serve.py: lora_adapters, serve_app) and served in this process."""
    from bunsan.training.data import load_tokenizer
    server = Server.of_command(*_lora_flags(base_dir, qwen[1]))
    try:
        _adapters_over_http(server.url, load_tokenizer(str(base_dir / "tokenizer.json")), qwen, base_dir)
    finally:
        server.close()


@pytest.mark.e2e
def test_adapters_loaded_at_run_time_in_the_model_process_of_bunsan_serve(qwen, base_dir):
    """The same through `bunsan serve` as a user starts it: the adapters load in the model's process, the
    HTTP process names them (serve/engine.py)."""
    from bunsan.training.data import load_tokenizer
    server = Launched(*_lora_flags(base_dir, qwen[1]), what="bunsan serve with LoRA adapters")
    try:
        _adapters_over_http(server.url, load_tokenizer(str(base_dir / "tokenizer.json")), qwen, base_dir)
    finally:
        out = server.close()
    assert "the model in a process of its own" in out, out


def _adapters_over_http(url: str, tokenizer, qwen, not_adapter) -> None:
    base, root, merged = qwen
    prompt = [5, 17, 42, 7, 99]

    def complete(model):
        r = http_post(url + "/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 6,
                                                     "temperature": 0})
        return r.status_code, r.json()
    assert complete("a")[1]["choices"][0]["text"] == tokenizer.decode(_greedy(merged["a"], prompt, 6))
    assert complete("base")[1]["choices"][0]["text"] == tokenizer.decode(_greedy(base, prompt, 6))
    assert complete("b")[0] == 404                           # not loaded yet
    bad = http_post(url + "/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": str(not_adapter)})
    assert bad.status_code == 400 and "is not a LoRA adapter" in bad.text
    r = http_post(url + "/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": str(root / "b")})
    assert r.status_code == 200, r.text
    answer = complete("b")
    assert answer[0] == 200, answer
    assert answer[1]["choices"][0]["text"] == tokenizer.decode(_greedy(merged["b"], prompt, 6))
    cards = {c["id"]: c for c in http_get(url + "/v1/models").json()["data"]}
    assert cards["b"]["parent"] == "base" and cards["base"]["parent"] is None
    full = http_post(url + "/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": str(root / "a")})
    assert full.status_code == 400 and "--max-loras" in full.text
    assert http_post(url + "/v1/unload_lora_adapter", json={"lora_name": "b"}).status_code == 200
    assert complete("b")[0] == 404
    assert http_post(url + "/v1/unload_lora_adapter", json={"lora_name": "b"}).status_code == 404


def test_the_commands_lora_flags(qwen):
    from bunsan.cli.main import build_parser
    from bunsan.cli.serve import lora_adapters
    from bunsan.serve.transformers_model import TransformersLM
    base, root, _ = qwen

    def parsed(*flags):
        return build_parser().parse_args(["serve", "--checkpoint", "x", *flags])
    adapters = lora_adapters(parsed("--lora-modules", f"a={root / 'a'}", str(root / "b")),
                             TransformersLM(copy.deepcopy(base)))
    assert set(adapters.slots) == {"a", "b"} and adapters.capacity == 2 and adapters.max_rank == 16
    assert lora_adapters(parsed(), TransformersLM(copy.deepcopy(base))) is None
    with pytest.raises(ValueError, match="with --tp: adapters are served in one process"):
        lora_adapters(parsed("--lora-modules", f"a={root / 'a'}", "--tp", "2"), TransformersLM(copy.deepcopy(base)))
    with pytest.raises(ValueError, match="--max-loras 1 is fewer than the 2 adapters"):
        lora_adapters(parsed("--lora-modules", f"a={root / 'a'}", f"b={root / 'b'}", "--max-loras", "1"),
                      TransformersLM(copy.deepcopy(base)))
    with pytest.raises(ValueError, match="rank 8 is above --max-lora-rank 4"):
        lora_adapters(parsed("--lora-modules", f"b={root / 'b'}", "--max-lora-rank", "4"),
                      TransformersLM(copy.deepcopy(base)))
