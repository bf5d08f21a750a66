"""bunsan serve's CPU linear layers from oneDNN's prepacked weights (serve/cpu_linear.py): the model's logits,
parameters and greedy tokens kept, and q/k/v (gate/up) run as one GEMM whatever order they are called in."""

from __future__ import annotations

import pytest
import torch

from parity import tiny_model

pytest.importorskip("httpx")
from serve_harness import run_until_done  # noqa: E402  (needs httpx)
from serve_harness import one_torch_thread  # noqa: E402,F401  (autouse: torch on one thread here)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["llama", "qwen2-tied"])
def test_prepacked_linears_give_the_models_logits_and_keep_its_parameters(kind, dtype):
    """bunsan serve's CPU layers from oneDNN's prepacked weights (serve/cpu_linear.py): the same logits within
    rounding, the same parameter count and bytes (a head tied to the embedding kept tied), greedy tokens
    through the batcher equal the unpacked model's."""
    import copy

    from collections import Counter

    from bunsan.serve.cpu_linear import PackedGroupMember, PackedLinear, pack_linears, packable
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if kind == "llama":
        model = tiny_model(0).eval().to(dtype)
    else:
        from bunsan.serve.transformers_model import TransformersLM
        model = TransformersLM(transformers.AutoModelForCausalLM.from_config(transformers.Qwen2Config(
            vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, tie_word_embeddings=True)).to(dtype))
    if not packable(model):
        pytest.skip("no oneDNN packed GEMM in this torch build")
    packed = copy.deepcopy(model)
    count = pack_linears(packed, rows=8)
    assert count == sum(type(m) is torch.nn.Linear for m in model.modules()) > 0
    assert all(type(m) is not torch.nn.Linear for m in packed.modules())
    params = lambda m: (sum(p.numel() for p in m.parameters()),                     # noqa: E731
                        sum(p.numel() * p.element_size() for p in m.parameters()))
    assert params(packed) == params(model)
    heads = [m for m in packed.modules() if isinstance(m, PackedLinear) and not m.weight.is_meta]
    assert len(heads) == (kind == "qwen2-tied")                    # the tied head's weight is the embedding's
    # each attention's q/k/v (Qwen2's with biases) and each MLP's gate/up run as one GEMM
    groups = Counter(id(m.group) for m in packed.modules() if isinstance(m, PackedGroupMember))
    layers = model.config.num_hidden_layers
    assert sorted(groups.values()) == [2] * layers + [3] * layers
    ids = torch.randint(3, 250, (1, 20))
    with torch.no_grad():
        want = model(ids) if kind == "llama" else model.hf_model(ids).logits
        got = packed(ids) if kind == "llama" else packed.hf_model(ids).logits
    torch.testing.assert_close(got.float(), want.float(), **({"rtol": 1e-4, "atol": 1e-4} if dtype == torch.float32
                                                             else {"rtol": 0.05, "atol": 0.05}))
    if dtype == torch.float32:
        from bunsan.serve.batcher import Batcher, Request
        outs = []
        for m in (model, packed):
            batcher, got_ids, ended = Batcher(m, 3, 64), [[] for _ in range(3)], []
            for i, p in enumerate([[5, 6, 7], [9] * 12, [11, 3]]):
                batcher.submit(Request(p, 12, emit=lambda t, i=i: got_ids[i].append(t.id), finish=ended.append))
            run_until_done(batcher, ended, 3)
            outs.append(got_ids)
        assert outs[0] == outs[1]


def test_a_packed_group_gives_each_member_its_own_layers_output_however_it_is_called():
    """q/k/v_proj packed as one GEMM (serve/cpu_linear.py) take their columns of one output only while their
    input is the same tensor, unchanged: a member called on other states (cross-attention's k/v), the same
    member twice, or an input changed in place between calls each get what their own nn.Linear gives."""
    import copy

    from bunsan.serve.cpu_linear import PackedGroupMember, pack_linears, packable
    torch.manual_seed(0)
    attention = torch.nn.Module()
    for name, width in (("q_proj", 48), ("k_proj", 16), ("v_proj", 16)):
        setattr(attention, name, torch.nn.Linear(32, width, bias=name != "v_proj"))
    if not packable(attention):
        pytest.skip("no oneDNN packed GEMM in this torch build")
    plain = copy.deepcopy(attention)
    assert pack_linears(attention, rows=8) == 3
    assert all(isinstance(getattr(attention, n), PackedGroupMember) for n in ("q_proj", "k_proj", "v_proj"))
    x, states = torch.randn(5, 32), torch.randn(7, 32)

    def check(name, inputs):
        torch.testing.assert_close(getattr(attention, name)(inputs), getattr(plain, name)(inputs),
                                   rtol=1e-4, atol=1e-4)
    with torch.no_grad():
        for name in ("v_proj", "q_proj", "k_proj"):        # any order
            check(name, x)
        check("q_proj", x)                                 # cross-attention: q on x, k and v on other states
        check("k_proj", states)
        check("v_proj", states)
        check("q_proj", x)                                 # the same member twice on one input
        check("q_proj", x)
        check("k_proj", x)
        x.mul_(2)                                          # changed in place before its last member's call
        check("v_proj", x)
        assert attention.q_proj.group._output is not None  # (the new output, for the other two)
        check("q_proj", x)
        check("k_proj", x)
        assert attention.q_proj.group._output is None      # every member served: nothing held
