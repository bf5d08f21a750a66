"""A transformers model in the DeepSpeed-style loop (`out = engine(**batch)`, `engine.backward(out.loss)`,
`engine.step()`), as DeepSpeed-Chat and HF Trainer scripts drive it: in training the engine passes use_cache=False
(as train_batch does), so the model keeps no KV cache, which selective recompute would find changed and refuse
("not found in storage"); the loop then trains as train_batch does."""

from __future__ import annotations

import pytest
import torch

import bunsan

pytest.importorskip("transformers")
from test_hf_models import data, tiny  # noqa: E402


@pytest.mark.parametrize("mode", ["selective", "full"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_the_deepspeed_style_loop_trains_a_transformers_model_under_recompute_as_train_batch(arch, mode):
    cfg = {"train_batch_size": 4, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "activation_checkpointing": {"mode": mode}}
    batches = data(2)
    loop = bunsan.initialize(tiny(arch), cfg)
    losses = []
    for batch in batches:
        out = loop(**batch)
        assert out.past_key_values is None              # no KV cache kept in training
        loop.backward(out.loss)
        loop.step()
        losses.append(out.loss.item())
    whole = bunsan.initialize(tiny(arch), cfg)
    assert losses == pytest.approx([whole.train_batch(b) for b in batches], rel=1e-5)
    torch.testing.assert_close(loop.module.state_dict(), whole.module.state_dict(), rtol=1e-5, atol=1e-6)


def test_the_caller_keeps_its_own_use_cache_and_eval_is_untouched():
    engine = bunsan.initialize(tiny("llama"), {"train_batch_size": 4, "optimizer": {"type": "SGD",
                                                                                    "params": {"lr": 0.1}}})
    ids = data(1)[0]["input_ids"]
    assert engine(input_ids=ids, use_cache=True).past_key_values is not None
    engine.module.eval()
    with torch.no_grad():
        assert engine(input_ids=ids).past_key_values is not None      # transformers' default where it generates
