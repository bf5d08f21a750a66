"""What DeepSpeed-Chat's RLHF steps lean on, in their forms: DeepSpeed's FusedLamb and FusedAdam(bias_correction
False) updates, the hybrid engine (the actor's model.generate on the training weights, ZeRO-3 included), a
reward model that wraps a transformers model built under zero.Init, and transformers' from_pretrained under
HfDeepSpeedConfig at ZeRO-3 loading the checkpoint's weights (bunsan.deepspeed.install())."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from bunsan.optim.deepspeed_optimizers import Lamb, UncorrectedAdam

pytest.importorskip("transformers")


def test_lamb_is_deepspeeds_fusedlamb_update():
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(6, 4))
    g1, g2 = torch.randn(6, 4), torch.randn(6, 4)
    opt = Lamb([p], lr=0.1, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.01, max_coeff=0.3, min_coeff=0.01)
    w, m, v = p.detach().clone(), torch.zeros(6, 4), torch.zeros(6, 4)
    for t, g in enumerate((g1, g2), start=1):
        p.grad = g.clone()
        opt.step()
        m, v = 0.9 * m + 0.1 * g, 0.99 * v + 0.01 * g * g          # the kernel's moments (never divided)
        u = m / (v.sqrt() + 1e-6) + 0.01 * w
        ratio = min(max((w.norm() / u.norm()).item(), 0.01), 0.3)
        w = w - 0.1 * (1 - 0.99 ** t) ** 0.5 / (1 - 0.9 ** t) * ratio * u
        torch.testing.assert_close(p.detach(), w)


def test_adam_without_bias_correction_is_deepspeeds():
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(5))
    g = torch.randn(5)
    w = p.detach().clone()
    for decoupled in (True, False):
        q = nn.Parameter(w.clone())
        opt = UncorrectedAdam([q], lr=0.1, weight_decay=0.1, decoupled_weight_decay=decoupled)
        q.grad = g.clone()
        opt.step()
        grad = g if decoupled else g + 0.1 * w
        m, v = 0.1 * grad, 0.001 * grad * grad
        want = (w * (1 - 0.01) if decoupled else w) - 0.1 * m / (v.sqrt() + 1e-8)
        torch.testing.assert_close(q.detach(), want)


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))


PROMPT = torch.tensor([[1, 5, 9, 3]])


def _hybrid_rank(rank, stage):
    import bunsan.deepspeed as ds
    from bunsan.deepspeed.zero_status import ZeroParamStatus
    engine, *_ = ds.initialize(model=_llama(), config={
        "train_batch_size": 2, "steps_per_print": 100, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "hybrid_engine": {"enabled": True, "max_out_tokens": 64}})
    engine.eval()
    tokens = engine.module.generate(PROMPT, max_new_tokens=5, do_sample=False)   # DeepSpeed-Chat's call
    released = stage < 3 or all(p.ds_status == ZeroParamStatus.NOT_AVAILABLE for p in engine.module.parameters())
    engine.train()
    out = engine(input_ids=PROMPT, labels=PROMPT)                                 # and training goes on
    engine.backward(out.loss)
    engine.step()
    return tokens.tolist(), released, engine.global_steps


@pytest.mark.parametrize("stage", [0, 3])
def test_hybrid_engine_generates_on_the_training_weights_then_trains(pools, stage):
    want = _llama().eval().generate(PROMPT, max_new_tokens=5, do_sample=False).tolist()
    for tokens, released, steps in pools.run(2, _hybrid_rank, stage):
        assert tokens == want and released and steps == 1


def _reward_rank(rank):
    import bunsan.deepspeed as ds
    from transformers import LlamaConfig, LlamaModel
    torch.manual_seed(0)
    with ds.zero.Init():                                 # the base model under Init, its head outside
        base = LlamaModel(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2))

    class RewardModel(nn.Module):                        # DeepSpeed-Chat's shape: a transformer and a value head
        def __init__(self, base):
            super().__init__()
            self.rwtransformer, self.v_head = base, nn.Linear(32, 1, bias=False)

        def forward(self, input_ids):
            return self.v_head(self.rwtransformer(input_ids=input_ids).last_hidden_state).squeeze(-1)

    torch.manual_seed(1)
    model = RewardModel(base)
    engine, *_ = ds.initialize(model=model, config={"train_batch_size": 2, "steps_per_print": 100,
                                                    "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
                                                    "zero_optimization": {"stage": 3}})
    with ds.zero.GatheredParameters(list(engine.module.parameters())):
        return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def test_zero3_takes_a_wrapper_around_a_model_built_under_init(pools):
    from transformers import LlamaConfig, LlamaModel
    torch.manual_seed(0)
    plain = LlamaModel(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2))
    for got in pools.run(2, _reward_rank):
        for name, value in plain.named_parameters():
            torch.testing.assert_close(got[f"rwtransformer.{name}"], value)
        assert got["v_head.weight"].shape == (1, 32)


class _LoRA(nn.Module):
    """DeepSpeed-Chat's LinearLayer_LoRA in its form: the base weight read through ds_shape or shape, adapters
    built outside zero.Init, and the layer moved with `.to(weight.device)` (dschat/utils/module/lora.py)."""

    def __init__(self, weight, bias, dim=4):
        super().__init__()
        self.weight, self.bias = weight, bias
        try:
            rows, columns = weight.ds_shape
        except AttributeError:
            rows, columns = weight.shape
        self.lora_right_weight = nn.Parameter(torch.zeros(columns, dim))
        self.lora_left_weight = nn.Parameter(torch.zeros(dim, rows))
        nn.init.kaiming_uniform_(self.lora_right_weight, a=5 ** 0.5)
        self.weight.requires_grad = False

    def forward(self, x):
        return nn.functional.linear(x, self.weight, self.bias) + x @ self.lora_right_weight @ self.lora_left_weight


def _lora_llama(stage):
    import contextlib
    import bunsan.deepspeed as ds
    with ds.zero.Init() if stage == 3 else contextlib.nullcontext():
        model = _llama()
    torch.manual_seed(1)
    for layer in model.model.layers:
        for name in ("q_proj", "v_proj"):
            linear = getattr(layer.self_attn, name)
            lora = _LoRA(linear.weight, linear.bias).to(linear.weight.device).to(linear.weight.dtype)
            setattr(layer.self_attn, name, lora)
    for name, p in model.named_parameters():         # dschat's only_optimize_lora_parameters
        p.requires_grad = "lora_" in name
    return model


def _lora_rank(rank, stage):
    import bunsan.deepspeed as ds
    model = _lora_llama(stage)
    engine, *_ = ds.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                               config={"train_batch_size": 2, "steps_per_print": 100,
                                       "optimizer": {"type": "SGD", "params": {"lr": 0.5}},
                                       "zero_optimization": {"stage": stage}})
    losses = []
    for _ in range(3):
        loss = engine(input_ids=PROMPT, labels=PROMPT).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("stage", [0, 3])
def test_deepspeed_chats_lora_layers_train_at_every_stage(pools, stage):
    """At ZeRO-3 the base weights are slices, and the adapters built beside them must keep their values."""
    model = _lora_llama(0)
    trained = [p for p in model.parameters() if p.requires_grad]
    assert len(trained) == 8
    opt = torch.optim.SGD(trained, lr=0.5)
    want = []
    for _ in range(3):
        loss = model(input_ids=PROMPT, labels=PROMPT).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        want.append(loss.item())
    assert want[0] != want[2]
    for got in pools.run(2, _lora_rank, stage):
        assert got == pytest.approx(want, rel=1e-5)


def _aliased(job, path: str) -> str:
    """A DeepSpeed-Chat script's part on a rank: `bunsan.deepspeed.install()` first, then its code as written
    against `import deepspeed` (the ranks stand for torchrun's workers; the group is made already)."""
    import bunsan.deepspeed
    bunsan.deepspeed.install()
    import deepspeed
    from transformers import AutoModelForCausalLM
    from transformers.integrations.deepspeed import HfDeepSpeedConfig
    deepspeed.init_distributed()
    job(deepspeed, AutoModelForCausalLM, HfDeepSpeedConfig, path)
    return "ok"


def _from_pretrained(deepspeed, AutoModelForCausalLM, HfDeepSpeedConfig, path):
    plain = AutoModelForCausalLM.from_pretrained(path)
    config = {"train_batch_size": 4, "zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}
    keep = HfDeepSpeedConfig(config)                    # noqa: F841 (as DeepSpeed-Chat's create_hf_model does)
    model = AutoModelForCausalLM.from_pretrained(path)
    engine, *_ = deepspeed.initialize(model=model, config=config)
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        for (name, got), (_, want) in zip(engine.module.named_parameters(), plain.named_parameters()):
            assert torch.equal(got.float(), want.to(torch.bfloat16).float()), name


def _resized(deepspeed, AutoModelForCausalLM, HfDeepSpeedConfig, path):
    plain = AutoModelForCausalLM.from_pretrained(path)
    config = {"train_batch_size": 4, "zero_optimization": {"stage": 3},
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    keep = HfDeepSpeedConfig(config)                    # noqa: F841
    model = AutoModelForCausalLM.from_pretrained(path)      # the output embedding tied after the build
    model.resize_token_embeddings(72)                       # DeepSpeed-Chat's create_hf_model
    engine, *_ = deepspeed.initialize(model=model, config=config)
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        embedding = engine.module.get_input_embeddings().weight
        assert embedding.shape == (72, 32), embedding.shape
        assert torch.equal(embedding[:64], plain.get_input_embeddings().weight)
        assert torch.equal(engine.module.get_output_embeddings().weight, embedding)


def _from_pretrained_rank(rank, path):
    return _aliased(_from_pretrained, path)


def _resized_rank(rank, path):
    return _aliased(_resized, path)


@pytest.fixture(scope="module")
def aliased_ranks(pools):
    """Two ranks as fresh as the processes torchrun starts: install() comes before transformers imports its
    DeepSpeed integration (in a rank that ran generate first, HfDeepSpeedConfig was built without DeepSpeed, as it
    would be in a script that called install() too late). Discarded after: they keep `import deepspeed` aliased
    to bunsan, which other tests' ranks must not."""
    pools.discard(2)
    yield pools
    pools.discard(2)


def test_from_pretrained_under_hf_deepspeed_config_loads_the_checkpoint_at_zero3(tmp_path, aliased_ranks):
    """transformers marks each loaded weight and re-initialises the unmarked ones afterwards (with every rank's
    own set order): zero.Init keeps the parameter objects and gathers in an order every rank shares."""
    _llama().save_pretrained(tmp_path / "model")
    assert aliased_ranks.run(2, _from_pretrained_rank, str(tmp_path / "model")) == ["ok", "ok"]


def test_a_tied_model_resized_under_zero3_keeps_its_rows(tmp_path, aliased_ranks):
    """resize_token_embeddings at ZeRO-3 builds the new embeddings beside the sliced ones (on their device)
    and copies the old rows in through the output embedding's slot, which took the weight after slicing."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    tied = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True))
    tied.save_pretrained(tmp_path / "model")
    assert aliased_ranks.run(2, _resized_rank, str(tmp_path / "model")) == ["ok", "ok"]
