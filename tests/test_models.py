"""Reference Llama: names, counts, meta construction, causality, GQA, tying, KV cache, presets."""
import math

import pytest
import torch
import torch.nn.functional as F

from bunsan.models import (KVCache, Llama, LlamaConfig, build_config, flops_per_token, generate,
                           get_preset, presets)
from bunsan.models.llama import Attention, rope_inv_freq, rope_tables


def _tiny(**kw) -> LlamaConfig:
    return build_config("tiny", **kw)


def _model(seed=0, **kw) -> Llama:
    m = Llama(_tiny(**kw))
    m.init_weights(seed=seed)
    return m


def _hf_names(n_layers: int, tied: bool) -> list[str]:
    names = ["embed_tokens.weight"]
    for i in range(n_layers):
        p = f"layers.{i}."
        names += [p + f"self_attn.{x}_proj.weight" for x in "qkvo"]
        names += [p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")]
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
    names.append("norm.weight")
    return names if tied else names + ["lm_head.weight"]


@pytest.mark.parametrize("tied", [False, True])
def test_param_names_match_hf_and_count(tied):
    m = _model(tie_word_embeddings=tied)
    assert sorted(n for n, _ in m.named_parameters()) == sorted(_hf_names(4, tied))
    assert sorted(m.state_dict()) == sorted(_hf_names(4, False))  # tied: both keys, one storage
    assert m.config.num_params() == sum(p.numel() for p in m.parameters())
    assert all("rope" not in k for k in m.state_dict())  # rope tables are recomputed, not saved
    if tied:
        assert m.lm_head.weight is m.embed_tokens.weight


def test_meta_construction_allocates_nothing_for_every_preset():
    for name, cfg in presets.items():
        with torch.device("meta"):
            m = Llama(cfg)
        assert all(p.is_meta for p in m.parameters()), name
        assert all(b.is_meta for b in m.buffers()), name
        assert cfg.num_params() == sum(p.numel() for p in m.parameters()), name
    assert presets["70b"].num_params() == pytest.approx(69.0e9, rel=0.01)
    assert presets["7b"].num_params() == pytest.approx(6.74e9, rel=0.01)
    assert presets["135m"].num_params() == pytest.approx(134.5e6, rel=0.005)
    assert presets["1b"].num_params() == pytest.approx(1.236e9, rel=0.005)


def test_meta_then_to_empty_matches_eager_init():
    eager = _model(seed=3)
    with torch.device("meta"):
        m = Llama(_tiny())
    m.to_empty(device="cpu")
    m.init_weights(seed=3)
    for (n, a), (_, b) in zip(eager.state_dict().items(), m.state_dict().items()):
        assert torch.equal(a, b), n
    assert torch.equal(m.rope_cos, eager.rope_cos) and torch.equal(m.rope_sin, eager.rope_sin)
    x = torch.randint(0, 256, (2, 16))
    assert torch.equal(m(x), eager(x))
    with torch.device("meta"):
        tied = Llama(_tiny(tie_word_embeddings=True))
    tied.to_empty(device="cpu")  # replaces Parameter objects; the tie must survive
    assert tied.lm_head.weight is tied.embed_tokens.weight
    assert tied.to(torch.float64).lm_head.weight is tied.embed_tokens.weight


def test_init_statistics():
    m = _model(seed=0)
    assert torch.all(m.norm.weight == 1) and torch.all(m.layers[0].input_layernorm.weight == 1)
    std = m.config.initializer_range
    assert m.layers[0].mlp.gate_proj.weight.std().item() == pytest.approx(std, rel=0.05)
    scaled = std / math.sqrt(2 * m.config.num_hidden_layers)
    assert m.layers[0].mlp.down_proj.weight.std().item() == pytest.approx(scaled, rel=0.05)


def test_rope_matches_hf_rotate_half_formula():
    cfg = _tiny()
    cos, sin = rope_tables(cfg)
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2).float() / d))
    pos = 7
    assert torch.allclose(cos[pos, : d // 2], torch.cos(pos * inv))
    assert torch.allclose(cos[pos, d // 2:], torch.cos(pos * inv))
    assert torch.allclose(sin[pos, d // 2:], torch.sin(pos * inv))


def test_llama3_rope_scaling_changes_low_frequencies_only():
    scaled = build_config("tiny", rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64})
    plain = build_config("tiny", rope_theta=500000.0)
    inv1, inv0 = rope_inv_freq(scaled), rope_inv_freq(plain)
    assert inv1[0] == inv0[0]  # highest frequency untouched
    assert torch.allclose(inv1[-1], inv0[-1] / 32)  # lowest divided by the factor
    assert not torch.allclose(rope_tables(scaled)[1], rope_tables(plain)[1])


def test_causal():
    m = _model()
    x = torch.randint(0, 256, (2, 32))
    y = x.clone()
    y[:, 20:] = (y[:, 20:] + 1) % 256
    a, b = m(x), m(y)
    assert a.shape == (2, 32, 256)
    assert torch.allclose(a[:, :20], b[:, :20], atol=1e-6)
    assert not torch.allclose(a[:, 20:], b[:, 20:])


def test_gqa_shapes():
    m = _model()
    att = m.layers[0].self_attn
    cfg = m.config
    assert cfg.num_key_value_heads == 2 and cfg.num_attention_heads == 4
    assert att.q_proj.weight.shape == (cfg.hidden_size, cfg.hidden_size)
    assert att.k_proj.weight.shape == (2 * cfg.head_dim, cfg.hidden_size)
    assert att.v_proj.weight.shape == (2 * cfg.head_dim, cfg.hidden_size)
    # GQA with kv heads repeated equals plain MHA with the repeated k/v weights.
    mha = _model(num_key_value_heads=4)
    mha.load_state_dict({k: v for k, v in m.state_dict().items() if not k.endswith(('k_proj.weight', 'v_proj.weight'))},
                        strict=False)
    for lm, lg in zip(mha.layers, m.layers):
        for p in ("k_proj", "v_proj"):
            w = getattr(lg.self_attn, p).weight.view(2, cfg.head_dim, -1).repeat_interleave(2, 0)
            getattr(lm.self_attn, p).weight.data.copy_(w.reshape(-1, cfg.hidden_size))
    x = torch.randint(0, 256, (2, 16))
    assert torch.allclose(m(x), mha(x), atol=1e-5)


class _Past:
    """A kv_cache_layer whose cached keys/values are leaves, so gradients reach them too."""

    def __init__(self, k, v, attn_mask=None):
        self.k, self.v = k, v
        if attn_mask is not None:
            self.attn_mask = attn_mask

    def update(self, k, v):
        return torch.cat([self.k, k], 2), torch.cat([self.v, v], 2)


def _attention_and_grads(att, x, past_k, past_v, mask, cos, sin):
    xs, ks, vs = (t.clone().requires_grad_() for t in (x, past_k, past_v))
    past, s = ks.shape[2], xs.shape[1]
    out = att(xs, cos[past:past + s], sin[past:past + s], _Past(ks, vs, mask) if past else None)
    leaves = [xs, *att.parameters()] + ([ks, vs] if past else [])
    weight = torch.linspace(-1, 1, out.numel()).view_as(out)   # every output element gets its own gradient
    return out.detach(), torch.autograd.grad((out * weight).sum(), leaves)


@pytest.mark.parametrize("path", ["causal", "decode", "chunk", "masked"])
def test_gqa_attention_equals_repeated_kv(monkeypatch, path):
    """enable_gqa (K/V with their own heads) gives what repeating K/V to every query head gave."""
    cfg = _tiny()
    assert cfg.num_attention_heads == 2 * cfg.num_key_value_heads
    torch.manual_seed(0)
    att = Attention(cfg)
    cos, sin = rope_tables(cfg)
    past, s = {"causal": (0, 12), "decode": (9, 1), "chunk": (9, 5), "masked": (9, 5)}[path]
    x = torch.randn(2, s, cfg.hidden_size)
    past_k, past_v = (torch.randn(2, cfg.num_key_value_heads, past, cfg.head_dim) for _ in range(2))
    mask = None
    if path == "masked":   # bunsan.serve's per-row mask: causal, and row 1 has two padding keys in front
        mask = torch.ones(2, 1, s, past + s, dtype=torch.bool).tril(diagonal=past)
        mask[1, :, :, :2] = False
    calls = []
    sdpa = F.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        calls.append((k.shape[1], kw.get("enable_gqa", False)))
        return sdpa(q, k, v, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    out, grads = _attention_and_grads(att, x, past_k, past_v, mask, cos, sin)
    monkeypatch.setattr(Attention, "native_gqa", staticmethod(lambda *a, **kw: False))
    ref, ref_grads = _attention_and_grads(att, x, past_k, past_v, mask, cos, sin)
    kv, heads = cfg.num_key_value_heads, cfg.num_attention_heads
    assert calls == [(kv, True), (heads, False)]   # grouped on the CPU, then the repeated reference
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)


def test_gqa_kernel_choice_keeps_cuda_off_the_math_kernel():
    native = Attention.native_gqa
    assert native("cuda", torch.bfloat16, 128, masked=False) and native("cuda", torch.float16, 64, masked=False)
    assert not native("cuda", torch.float32, 128, masked=False)   # the memory-efficient kernel: equal heads
    assert not native("cuda", torch.bfloat16, 128, masked=True)   # flash takes no mask
    assert not native("cuda", torch.bfloat16, 512, masked=False)  # beyond flash's head_dim
    assert native("cpu", torch.float32, 128, masked=True) and not native("mps", torch.float16, 64, masked=False)
    assert not native("cuda", torch.bfloat16, 128, False, capability=(7, 0))       # V100: no flash
    assert not native("cuda", torch.bfloat16, 100, False)                          # head_dim not a multiple of 8
    assert not native("cuda", torch.bfloat16, 256, False, capability=(8, 6))       # A10 trains flash <= 192
    assert native("cuda", torch.bfloat16, 256, False, capability=(8, 6), training=False)
    assert native("cuda", torch.bfloat16, 128, False, capability=(8, 9))


def test_tied_vs_untied_counts():
    tied, untied = _tiny(tie_word_embeddings=True), _tiny()
    assert untied.num_params() - tied.num_params() == 256 * 128
    assert tied.num_params(include_embedding=False) == tied.num_params()  # table counted as LM head
    assert untied.num_params(include_embedding=False) == untied.num_params() - 256 * 128
    assert flops_per_token(untied, 64) == 6 * untied.num_params(False) + 12 * 4 * 128 * 64


def test_kv_cache_generation_equals_no_cache_greedy():
    m = _model(seed=1)
    prompt = torch.randint(0, 256, (2, 5))
    with_cache = generate(m, prompt, max_new_tokens=12)
    # Recompute the whole sequence each step, no cache.
    seq = prompt
    with torch.no_grad():
        for _ in range(12):
            seq = torch.cat([seq, m(seq)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(with_cache, seq)
    assert torch.equal(generate(m, prompt, 12, use_cache=False), seq)


def test_kv_cache_chunked_prefill_uses_correct_mask():
    m = _model(seed=2)
    x = torch.randint(0, 256, (2, 20))
    full = m(x)
    cache = KVCache(m.config, 2, 20)
    with torch.no_grad():
        a = m(x[:, :8], kv_cache=cache)
        b = m(x[:, 8:15], kv_cache=cache)  # chunk of 7 after a prefix: needs an explicit mask
        c = m(x[:, 15:], kv_cache=cache)
    assert torch.allclose(torch.cat([a, b, c], 1), full, atol=1e-5)


def test_sampling_eos_and_limits():
    m = _model()
    prompt = torch.randint(0, 256, (3, 4))
    g = torch.Generator().manual_seed(0)
    s1 = generate(m, prompt, 8, temperature=1.0, top_k=5, generator=g)
    s2 = generate(m, prompt, 8, temperature=1.0, top_k=5, generator=torch.Generator().manual_seed(0))
    assert torch.equal(s1, s2) and s1.shape == (3, 12)
    greedy = generate(m, prompt, 3)
    eos = int(greedy[0, 4])  # the first greedy token of row 0 becomes "eos"
    out = generate(m, prompt, 8, eos_token_id=eos)
    assert torch.all(out[0, 4:] == eos)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        generate(m, prompt, 600)


@pytest.mark.parametrize("kw, field", [
    (dict(hidden_size=130), "hidden_size"),
    (dict(num_key_value_heads=3), "num_key_value_heads"),
    (dict(hidden_size=132, num_attention_heads=12, num_key_value_heads=12), "head_dim"),
    (dict(num_hidden_layers=0), "num_hidden_layers"),
    (dict(vocab_size=2.5), "vocab_size"),
    (dict(rms_norm_eps=0.0), "rms_norm_eps"),
])
def test_config_validation(kw, field):
    base = dict(vocab_size=256, hidden_size=128, num_attention_heads=4, num_key_value_heads=2)
    base.update(kw)
    with pytest.raises(ValueError, match=field):
        LlamaConfig(**base)


def test_hf_config_roundtrip_and_presets():
    hf = presets["1b"].to_hf()
    assert hf["model_type"] == "llama" and hf["head_dim"] == 64
    back = LlamaConfig.from_hf({**hf, "bos_token_id": 1, "torch_dtype": "bfloat16"})
    assert back == presets["1b"]
    with pytest.raises(ValueError, match="attention_bias"):
        LlamaConfig.from_hf({**hf, "attention_bias": True})
    c = get_preset("small")
    c.hidden_size = 1
    assert presets["small"].hidden_size == 256  # copies are independent
    with pytest.raises(ValueError, match="did you mean 'small'"):
        get_preset("smal")
    assert build_config("small", num_hidden_layers=2, hidden_size=None).num_hidden_layers == 2
    assert build_config("7b", num_attention_heads=16).num_key_value_heads == 16  # MHA stays MHA
    with pytest.raises(ValueError, match="did you mean 'hidden_size'"):
        build_config("tiny", hiden_size=64)


def test_head_dim_set_apart_from_hidden_over_heads():
    """HF's head_dim (Mistral Nemo: 128 on 5120 / 32 heads; Qwen3 0.6B: 128 on 1024 / 16): q_proj and o_proj are
    heads x head_dim wide, config.json keeps it both ways, and a preset's overrides derive it again from a new
    width or head count unless they name it."""
    nemo = {"model_type": "llama", "vocab_size": 131072, "hidden_size": 5120, "intermediate_size": 14336,
            "num_hidden_layers": 40, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128}
    c = LlamaConfig.from_hf(nemo)
    assert (c.head_dim, c.attention_dim, c.head_dim_derived) == (128, 4096, False)
    assert c.to_hf()["head_dim"] == 128 and LlamaConfig.from_hf(c.to_hf()) == c
    kv = 8 * 128
    assert c.num_params() == 40 * (2 * 5120 * 4096 + 2 * 5120 * kv + 3 * 5120 * 14336 + 2 * 5120) + 5120 \
        + 2 * 131072 * 5120
    assert flops_per_token(c, 1000) == 6 * c.num_params(include_embedding=False) + 12 * 40 * 4096 * 1000
    assert LlamaConfig(hidden_size=130, num_attention_heads=4, num_key_value_heads=2, head_dim=32).attention_dim == 128
    with pytest.raises(ValueError, match="or give head_dim"):
        LlamaConfig(hidden_size=130, num_attention_heads=4)
    with pytest.raises(ValueError, match="head_dim 7 is odd"):
        LlamaConfig(head_dim=7)
    with pytest.raises(ValueError, match="head_dim must be a positive int"):
        LlamaConfig(head_dim=0)
    assert build_config("tiny", hidden_size=256).head_dim == 64             # derived again: 4 heads
    assert build_config("tiny", num_attention_heads=8, num_key_value_heads=2).head_dim == 16
    assert build_config("tiny", head_dim=48).attention_dim == 192
    assert build_config("tiny", head_dim=48, hidden_size=256).head_dim == 48
    assert get_preset("tiny").replace(head_dim=48).replace(hidden_size=256).head_dim == 48   # set apart: kept
    model = Llama(build_config("tiny", head_dim=48))
    ids = torch.randint(0, 256, (2, 12))
    assert model(ids).shape == (2, 12, 256) and model.layers[0].self_attn.q_proj.weight.shape == (192, 128)


def test_llama31_presets_are_metas_configs_and_answer_to_their_usual_names():
    """meta-llama/Llama-3.1-8B's config.json (70B and 405B differ in the four shape fields only), and the names
    a user types for them; a name that is no preset says what is."""
    hf_8b = {"model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
             "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
             "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
             "tie_word_embeddings": False, "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0,
                                                           "high_freq_factor": 4.0, "rope_type": "llama3",
                                                           "original_max_position_embeddings": 8192}}
    assert LlamaConfig.from_hf(hf_8b) == presets["llama3-8b"]
    shapes = {"llama3-70b": (8192, 28672, 80, 64), "llama3-405b": (16384, 53248, 126, 128)}
    for name, (hidden, inter, layers, heads) in shapes.items():
        assert LlamaConfig.from_hf({**hf_8b, "hidden_size": hidden, "intermediate_size": inter,
                                    "num_hidden_layers": layers, "num_attention_heads": heads}) == presets[name]
    # Meta's model cards: 8.03B, 70.6B, 405B parameters
    assert [presets[f"llama3-{s}"].num_params() / 1e9 for s in ("8b", "70b", "405b")] == \
        pytest.approx([8.03, 70.55, 405.85], abs=0.01)
    for typed in ("Llama-3.1-8B", "llama3.1-8b", "llama-3-8b", "meta-llama-3.1-8b", "llama3-8b"):
        assert get_preset(typed) == presets["llama3-8b"], typed
    assert get_preset("Llama-3.2-1B") == presets["1b"] and get_preset("llama-2-70b") == presets["70b"]
    with pytest.raises(ValueError, match=r"'llama4-8b' \(did you mean 'llama3-8b'\?\); known presets: .*llama3-405b"
                                         r".*Hugging Face config.json"):
        get_preset("llama4-8b")


def test_training_reduces_loss():
    torch.manual_seed(0)
    m = _model(seed=0)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    x = torch.randint(0, 256, (4, 33))
    losses = []
    for _ in range(6):
        loss = F.cross_entropy(m(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(math.log(256), abs=0.3)
    assert losses[-1] < losses[0] - 0.5


def test_blocks_work_under_activation_checkpointing():
    from torch.utils.checkpoint import checkpoint
    m = _model()
    x = torch.randint(0, 256, (2, 16))
    ref = m(x).sum()
    ref.backward()
    g_ref = m.layers[0].mlp.up_proj.weight.grad.clone()
    m.zero_grad()
    h = m.embed_tokens(x)
    cos, sin = m.rope_cos[:16], m.rope_sin[:16]
    for layer in m.layers:
        h = checkpoint(layer, h, cos, sin, use_reentrant=False)
    out = m.lm_head(m.norm(h)).sum()
    out.backward()
    assert torch.allclose(out, ref) and torch.allclose(m.layers[0].mlp.up_proj.weight.grad, g_ref, atol=1e-6)
