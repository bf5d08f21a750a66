"""A user's loss never sees a shard: under a vocabulary-parallel head (tensor parallelism's default for a
Hugging Face model, tp_plan="auto", and for bunsan's Llama) a `loss_fn`, the DeepSpeed-style `engine(inputs)`
and a Hugging Face model's own loss get the whole vocabulary's logits; the engine's own loss keeps the slices.
Against the plain loop with the same loss, SGD without clipping, fp32, rtol 1e-5; labels over the whole
vocabulary (a slice's loss would index past its columns) and labels in the first half only (where it would
train silently wrong)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import bunsan
from parity import assert_parity, batches, tiny_model, to_numpy
from test_hf_models import LR, VOCAB, reference_from, tiny

transformers = pytest.importorskip("transformers")

ROWS, SEQ = 4, 12


def hf_llama():
    return tiny("llama")       # test_hf_models' tiny transformers Llama (vocabulary 64), seeded


def hf_data(low_half: bool, steps: int = 3) -> list[dict]:
    g = torch.Generator().manual_seed(5)
    high = VOCAB // 2 if low_half else VOCAB
    return [{"input_ids": (ids := torch.randint(0, high, (ROWS, SEQ), generator=g)), "labels": ids.clone()}
            for _ in range(steps)]


def shifted_ce(output, labels):
    """The user's loss, as HF users write it: next-token cross-entropy over output.logits."""
    logits = output.logits if hasattr(output, "logits") else output
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1))


def _cfg(**extra):
    return {"train_batch_size": ROWS, "optimizer": {"type": "SGD", "params": {"lr": LR}}, "train": {"timeout_s": 60},
            **extra}


def _hf_reference(data, use_model_loss: bool = False):
    model = hf_llama()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for b in data:
        out = model(**b) if use_model_loss else model(b["input_ids"])
        loss = out.loss if use_model_loss else shifted_ce(out, b["labels"])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, model.state_dict()


def _hf_train(rank, world, data, mode):
    engine = bunsan.initialize(hf_llama(), _cfg(tensor_parallel={"size": 2}),
                               loss_fn=shifted_ce if mode == "loss_fn" else None)
    assert engine.tp_head is not None, "the HF plan makes the head vocabulary-parallel"
    losses = []
    for b in data:
        if mode == "loss_fn":
            losses.append(engine.train_batch(b))
            continue
        out = engine(**b) if mode == "model_loss" else engine(b["input_ids"])
        assert out.logits.shape[-1] == VOCAB, "engine(inputs) returns the whole vocabulary's logits"
        loss = out.loss if mode == "model_loss" else shifted_ce(out, b["labels"])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses, to_numpy(engine.consolidated_state_dict())


@pytest.mark.parametrize("low_half", [False, True])
@pytest.mark.parametrize("mode", ["loss_fn", "deepspeed_loop", "model_loss"])
def test_a_users_loss_under_tp_on_a_hf_model_matches_the_plain_loop(pools, mode, low_half):
    data = hf_data(low_half)
    ref = _hf_reference(data, use_model_loss=mode == "model_loss")
    assert_parity(pools.run(2, _hf_train, 2, data, mode), ref, what=f"{mode}, low_half={low_half}")


def test_the_engines_own_loss_keeps_the_slices(pools):
    """Without a loss_fn the engine's vocabulary-parallel loss runs on each rank's slice, as before."""
    data = hf_data(False)
    assert_parity(pools.run(2, _engine_loss, 2, data), reference_from(hf_llama(), data))


def _engine_loss(rank, world, data):
    engine = bunsan.initialize(hf_llama(), _cfg(tensor_parallel={"size": 2}))
    seen = []
    engine.tp_head.register_forward_hook(lambda m, a, out: seen.append(out.shape[-1]))
    losses = [engine.train_batch(b) for b in data]
    assert set(seen) == {VOCAB // 2}, seen
    return losses, to_numpy(engine.consolidated_state_dict())


# -- bunsan's Llama with (input, target) tuples, TP with and without sequence parallelism, and PP -------------
def _tuple_data():
    return [(b["input_ids"], b["labels"]) for b in batches(3, 8, 16)]


def next_token_ce(logits, labels):
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1))


def _llama_train(rank, world, cfg):
    engine = bunsan.initialize(tiny_model(), cfg, loss_fn=next_token_ce)
    rows = 8 // engine.dp_size
    losses = [engine.train_batch(tuple(t[engine.dp_rank * rows:(engine.dp_rank + 1) * rows] for t in b))
              for b in _tuple_data()]
    return losses, to_numpy(engine.consolidated_state_dict())


LAYOUTS = {
    "tp2": {"tensor_parallel": {"size": 2}},
    "tp2-sp": {"tensor_parallel": {"size": 2, "sequence_parallel": True}},
    "pp2": {"pipeline": {"stages": 2}, "gradient_accumulation_steps": 2},
    "dp2-zero3": {"zero_optimization": {"stage": 3}},
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_a_loss_fn_on_bunsans_llama_sees_whole_logits(pools, name):
    cfg = {"train_batch_size": 8, "optimizer": {"type": "SGD", "params": {"lr": 0.05}}, "train": {"timeout_s": 60},
           **LAYOUTS[name]}
    micro = cfg.get("gradient_accumulation_steps", 1)
    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ref = []
    for x, y in _tuple_data():
        loss = sum(next_token_ce(model(xc), yc) for xc, yc in zip(x.chunk(micro), y.chunk(micro))) / micro
        opt.zero_grad()
        loss.backward()
        opt.step()
        ref.append(loss.item())
    assert_parity(pools.run(2, _llama_train, 2, cfg), (ref, model.state_dict()), what=name)


def test_a_loss_fns_whole_logits_are_priced():
    from bunsan.estimator import estimate
    cfg = {"train_micro_batch_size_per_gpu": 2, "tensor_parallel": {"size": 2}, "bf16": {"enabled": True},
           "data": {"seq_len": 512}}
    plain = estimate("1b", cfg, gpus=2)
    with_loss = estimate("1b", cfg, gpus=2, loss_fn=True)
    item = next(i for i in with_loss.items if i.name == "loss_fn's whole logits")
    vocab = with_loss.shape.llama.vocab_size
    assert item.device == 2 * 512 * vocab * 2                      # b x s x V in bf16, whole on each TP rank
    assert with_loss.peak == pytest.approx(plain.peak + item.device)
    assert not any(i.name == "loss_fn's whole logits" for i in estimate("1b", {**cfg, "tensor_parallel": {
        "size": 1}}, gpus=1, loss_fn=True).items)                   # no tensor parallelism: nothing gathered
