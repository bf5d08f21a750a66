"""train.objective dpo: the loss and the step equal the DPO formula computed by an independent plain loop
(log-softmax gathered by hand, the mean over pairs, torch's SGD) from the same weights, pairs and reference
log-probs, at ZeRO 0-3, with tensor, pipeline and context parallelism, with accumulation; SGD without clipping,
so a gradient-scale error shows. Rafailov et al. 2023: loss = -log sigmoid(beta ((pi_c - ref_c) - (pi_r - ref_r))),
with label smoothing eps: -(1-eps) log sigmoid(beta m) - eps log sigmoid(-beta m)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import bunsan
from parity import VOCAB, tiny_model

PAIRS, SEQ, PROMPT, LR, BETA, SMOOTH = 4, 16, 6, 0.5, 0.3, 0.1


def pair_batch(seed: int = 3) -> dict:
    """PAIRS pairs, rows interleaved (chosen, rejected): a shared prompt, different responses."""
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, VOCAB, (PAIRS, PROMPT), generator=g)
    rows = []
    for p in prompt:
        for _ in range(2):
            rows.append(torch.cat([p, torch.randint(0, VOCAB, (SEQ + 1 - PROMPT,), generator=g)]))
    ids = torch.stack(rows)
    labels = ids[:, 1:].clone()
    labels[:, :PROMPT - 1] = -100                     # only the response is scored
    return {"input_ids": ids[:, :-1].contiguous(), "labels": labels}


def plain_logps(model, batch) -> torch.Tensor:
    logp = F.log_softmax(model(batch["input_ids"]).float(), dim=-1)
    mask = batch["labels"] != -100
    picked = logp.gather(-1, batch["labels"].clamp(min=0)[..., None])[..., 0]
    return (picked * mask).sum(-1)


def plain_dpo(model, batch, ref) -> torch.Tensor:
    pi = plain_logps(model, batch)
    m = (pi[0::2] - ref[0::2]) - (pi[1::2] - ref[1::2])
    return (-(1 - SMOOTH) * F.logsigmoid(BETA * m) - SMOOTH * F.logsigmoid(-BETA * m)).mean()


def reference_run(steps: int = 2):
    model = tiny_model(0)
    batch = pair_batch()
    with torch.no_grad():
        initial = plain_logps(model, batch)
    # a reference other than the start, so that the first margin, loss and gradient are not DPO's trivial ones
    ref = initial + torch.linspace(-1.5, 1.0, 2 * PAIRS)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for _ in range(steps):
        loss = plain_dpo(model, batch, ref)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, ref, initial


def _rank(rank, world, layout, accum, ref):
    cfg = {"train_batch_size": 2 * PAIRS, "gradient_accumulation_steps": accum, "gradient_clipping": 0.0,
           "optimizer": {"type": "SGD", "params": {"lr": LR}}, "train": {"objective": "dpo"},
           "dpo": {"beta": BETA, "label_smoothing": SMOOTH}, **layout}
    engine = bunsan.initialize(tiny_model(0), cfg)
    batch = {**pair_batch(), "ref_logps": ref}
    per = 2 * PAIRS // engine.dp_size
    mine = {k: v[engine.dp_rank * per:(engine.dp_rank + 1) * per] for k, v in batch.items()}
    from bunsan.engine.preference import sequence_logps
    # the reference as bunsan computes it, before any step
    own_ref = sequence_logps(engine, mine)
    losses = [engine.train_batch(mine) for _ in range(2)]
    return losses, engine.consolidated_state_dict(), own_ref, engine.dp_rank


def ragged_pairs() -> dict:
    """pair_batch with responses of different lengths (the last i % 4 targets of row i not scored): a length
    normalisation that summed instead of averaging would show."""
    batch = pair_batch()
    for i in range(batch["labels"].shape[0]):
        if i % 4:
            batch["labels"][i, -(i % 4):] = -100
    return batch


def plain_reference_free(model, batch, kind: str) -> torch.Tensor:
    """SimPO and ORPO from their papers' formulas, on each row's mean log-prob of its scored tokens."""
    mean = plain_logps(model, batch) / (batch["labels"] != -100).sum(-1)
    if kind == "simpo":
        return -F.logsigmoid(SIMPO_BETA * (mean[0::2] - mean[1::2]) - SIMPO_GAMMA).mean()
    p = mean.exp()
    odds = torch.log(p / (1 - p))
    return (-mean[0::2] - ORPO_BETA * F.logsigmoid(odds[0::2] - odds[1::2])).mean()


def _reference_free_rank(rank, world, kind, layout):
    sections = {"simpo": {"beta": SIMPO_BETA, "gamma": SIMPO_GAMMA}, "orpo": {"beta": ORPO_BETA}}
    cfg = {"train_batch_size": 2 * PAIRS, "gradient_clipping": 0.0, "optimizer": {"type": "SGD", "params": {"lr": LR}},
           "gradient_accumulation_steps": 2 if "pipeline" in layout else 1,
           "train": {"objective": kind}, kind: sections[kind], **layout}
    engine = bunsan.initialize(tiny_model(0), cfg)
    batch = ragged_pairs()                  # no ref_logps: the objective needs none
    per = 2 * PAIRS // engine.dp_size
    mine = {k: v[engine.dp_rank * per:(engine.dp_rank + 1) * per] for k, v in batch.items()}
    losses = [engine.train_batch(mine) for _ in range(2)]
    return losses, engine.consolidated_state_dict()


SIMPO_BETA, SIMPO_GAMMA, ORPO_BETA = 2.0, 0.3, 0.4


@pytest.mark.parametrize("layout", ["zero0", "zero3", "tp2", "pp2", "cp2"])
@pytest.mark.parametrize("kind", ["simpo", "orpo"])
def test_reference_free_objectives_equal_their_formulas(pools, kind, layout):
    model = tiny_model(0)
    batch = ragged_pairs()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    want = []
    for _ in range(2):
        loss = plain_reference_free(model, batch, kind)
        opt.zero_grad()
        loss.backward()
        opt.step()
        want.append(loss.item())
    assert want[0] != pytest.approx(want[1], rel=1e-3)
    for losses, state in pools.run(2, _reference_free_rank, 2, kind, LAYOUTS[layout]):
        assert losses == pytest.approx(want, rel=1e-5)
        for k, v in model.state_dict().items():
            torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-6, msg=lambda m: f"{kind} {layout} {k}: {m}")


LAYOUTS = {"zero0": {}, "zero1": {"zero_optimization": {"stage": 1}}, "zero2": {"zero_optimization": {"stage": 2}},
           "zero3": {"zero_optimization": {"stage": 3}}, "tp2": {"tensor_parallel": {"size": 2}},
           "pp2": {"pipeline": {"stages": 2, "schedule": "1f1b"}}, "cp2": {"context_parallel": {"size": 2}}}


@pytest.mark.parametrize("name,accum", [(n, 1) for n in LAYOUTS if n != "pp2"] + [("zero2", 2), ("pp2", 2)])
def test_dpo_equals_the_formula_in_a_plain_loop(pools, name, accum):
    want_losses, want_state, ref, initial = reference_run()
    assert want_losses[0] != pytest.approx(want_losses[1], rel=1e-3)        # the step moved the loss
    assert want_losses[0] != pytest.approx(0.6931472, rel=1e-3)                # not log 2: the margin is not 0
    for losses, state, own_ref, dp_rank in pools.run(2, _rank, 2, LAYOUTS[name], accum, ref):
        per = 2 * PAIRS // (1 if name in ("tp2", "pp2", "cp2") else 2)
        torch.testing.assert_close(own_ref, initial[dp_rank * per:(dp_rank + 1) * per].double(), rtol=1e-5,
                                   atol=1e-5)
        assert losses == pytest.approx(want_losses, rel=1e-5)
        for k, v in want_state.items():
            torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name} {k}: {m}")


def test_a_preference_batch_must_carry_reference_log_probs():
    engine = bunsan.initialize(tiny_model(0), {"train_batch_size": 2, "train": {"objective": "dpo"},
                                               "optimizer": {"type": "SGD", "params": {"lr": LR}}})
    batch = pair_batch()
    with pytest.raises(ValueError, match="ref_logps"):
        engine.train_batch({k: v[:2] for k, v in batch.items()})
    with pytest.raises(ValueError, match="even number"):
        odd = bunsan.initialize(tiny_model(0), {"train_batch_size": 1, "train": {"objective": "dpo"},
                                                "optimizer": {"type": "SGD", "params": {"lr": LR}}})
        odd.train_batch({**{k: v[:1] for k, v in batch.items()}, "ref_logps": torch.zeros(1)})


# -- bunsan train --format preference ---------------------------------------------------------------------------
def _pairs_file(path, conversational: bool):
    import json
    records = []
    for i in range(12):
        q = f"What is {i} plus {i}?"
        good, bad = f"It is {2 * i}.", f"It is {2 * i + 1}, I think."
        if conversational:
            records.append({"prompt": [{"role": "user", "content": q}],
                            "chosen": [{"role": "assistant", "content": good}],
                            "rejected": [{"role": "assistant", "content": bad}]})
        else:
            records.append({"prompt": q + " ", "chosen": good, "rejected": bad})
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    """A tiny transformers model (Qwen2) with a chat template: the conversational cases start from it."""
    transformers = pytest.importorskip("transformers")
    from chat_tokenizer import save_chat_tokenizer
    model_dir = tmp_path_factory.mktemp("qwen")
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(transformers.Qwen2Config(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128)).save_pretrained(model_dir)
    save_chat_tokenizer(model_dir)
    return model_dir


@pytest.mark.parametrize("conversational,layout,objective", [
    (False, ["--zero", "2"], "dpo"), (True, ["--zero", "2"], "dpo"), (False, ["--pp", "2", "--grad-accum", "2"], "dpo"),
    (False, ["--cp", "2"], "dpo"), (False, ["--zero", "1"], "simpo"), (True, ["--zero", "1"], "orpo")],
    ids=["text-zero2", "chat-zero2", "text-pp2", "text-cp2", "simpo-text", "orpo-chat"])
def test_bunsan_train_dpo_starts_at_log_2_and_prefers_the_chosen(pools, request, tmp_path, conversational, layout,
                                                                 objective):
    """With the model before training as the reference, every pair's first margin is 0: the first loss is
    log 2 exactly when the reference's forward is the training forward; then the chosen responses win (and
    under SimPO and ORPO, which need no reference)."""
    import json
    args = ["train", "--nproc", "2", "--format", "preference", "--data",
            _pairs_file(tmp_path / "pairs.jsonl", conversational), "--steps", "6", "--micro-batch", "2",
            "--seq-len", "48", *layout, "--lr", "3e-3", "--output", tmp_path / "out",
            "--set", f"train.objective={objective}", "--set", "data.val_fraction=0", "--set", "steps_per_print=1",
            "--set", "scheduler.params.warmup_steps=0"]
    if conversational:          # the chat template's path, on a transformers model (Qwen2)
        args += ["--init-from", request.getfixturevalue("qwen_dir")]
    ranks = pools.cli(2, args, cwd=tmp_path)
    assert [r.returncode for r in ranks] == [0, 0], ranks
    assert "12 examples, 12 used" in "".join(r.stderr for r in ranks)
    losses = [json.loads(line)["loss"] for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()
              if "loss" in json.loads(line)]
    if objective == "dpo":                  # (the reference-free objectives have no such start)
        assert losses[0] == pytest.approx(0.6931472, rel=1e-5)
    assert losses[-1] < losses[0]


def test_reference_log_probs_from_the_records_reach_the_batches(tmp_path):
    """dpo.reference records: each pair's ref_chosen_logps / ref_rejected_logps ride with its two rows through
    the shuffled, data-parallel batches; a record without them is refused naming it."""
    import json
    from bunsan.training.chat_records import BadRecord
    from bunsan.training.example_batches import ExampleBatches
    from bunsan.training.examples import Renderer, read_records
    from bunsan.training.preference_data import pair_rows
    from bunsan.training.tokenizer import ByteTokenizer
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"q{i} ", "chosen": "yes", "rejected": "no",
                                        "ref_chosen_logps": -i, "ref_rejected_logps": -100 - i}) + "\n"
                            for i in range(8)))
    renderer = Renderer("preference", ByteTokenizer(), None, {}, False)
    rows = pair_rows(read_records([path]), renderer, 16, 0, "records")
    assert rows.pairs and rows.ids.shape[0] == 16
    seen = []
    for rank in (0, 1):
        b = ExampleBatches(rows, 8, rank, 2, seed=5, val_fraction=0).batch_at(0)
        ref = b["ref_logps"].numpy()
        prompts = [bytes(int(t) for t in r[:3]).decode() for r in b["input_ids"]]
        for k in range(0, len(prompts), 2):
            i = int(prompts[k].strip()[1:])
            assert prompts[k] == prompts[k + 1] and list(ref[k:k + 2]) == [-i, -100 - i]   # a pair, its refs
            seen.append(i)
    assert len(set(seen)) == 4                          # the global batch: 4 distinct pairs over the 2 ranks
    path.write_text(json.dumps({"prompt": "q", "chosen": "yes", "rejected": "no"}) + "\n")
    with pytest.raises(BadRecord, match=r"pairs.jsonl:1: dpo.reference records reads"):
        pair_rows(read_records([path]), renderer, 16, 0, "records")


def test_a_reference_free_row_without_scored_tokens_is_refused():
    engine = bunsan.initialize(tiny_model(0), {"train_batch_size": 2, "train": {"objective": "simpo"},
                                               "optimizer": {"type": "SGD", "params": {"lr": LR}}})
    batch = {k: v[:2].clone() for k, v in pair_batch().items()}
    batch["labels"][1] = -100                           # the rejected response has no scored token
    with pytest.raises(RuntimeError, match="simpo's mean token log-prob needs a response in every row"):
        engine.train_batch(batch)
