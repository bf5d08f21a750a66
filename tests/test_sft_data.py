"""Fine-tuning data: records in JSONL, Parquet and saved `datasets` directories, in the text,
prompt_completion, instruction and chat formats; the loss only on the response tokens (checked token by
token against the chat template's rendering); deterministic, resumable batches; `bunsan train --init-from
HF_DIR --lora --data chat.jsonl --format chat` end to end."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from bunsan.training.example_batches import ExampleBatches, example_rows  # noqa: E402
from bunsan.training.examples import Renderer, read_records  # noqa: E402
from bunsan.training.tokenizer import ByteTokenizer, load_tokenizer  # noqa: E402
from chat_tokenizer import save_chat_tokenizer  # noqa: E402

CHATS = [{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"Add {i} and 1"},
                       {"role": "assistant", "content": f"It is {i + 1}."},
                       {"role": "user", "content": "Thanks"}, {"role": "assistant", "content": "Welcome!"}]}
         for i in range(12)]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    save_chat_tokenizer(d)
    return d


def _jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _trained_text(tok, ids, trained):
    return tok.decode([i for i, t in zip(ids, trained) if t])


def test_chat_loss_is_on_the_assistant_turns_exactly(tok_dir, tmp_path):
    tok = load_tokenizer(tok_dir)
    r = Renderer("chat", tok, tok_dir, {}, train_on_prompt=False)
    ids, trained = r.render(CHATS[3], "x")
    assert tok.decode(ids) == r.hf.apply_chat_template(CHATS[3]["messages"], tokenize=False)
    assert _trained_text(tok, ids, trained) == "It is 4.<|im_end|>\nWelcome!<|im_end|>\n"   # the template's EOS
    ids2, trained2 = Renderer("chat", tok, tok_dir, {}, train_on_prompt=True).render(CHATS[3], "x")
    assert ids2 == ids and all(trained2)


def test_prompt_completion_and_instruction(tok_dir):
    tok = load_tokenizer(tok_dir)
    ids, trained = Renderer("prompt_completion", tok, None, {"prompt": "q", "completion": "a"}, False).render(
        {"q": "2+2=", "a": "4"}, "x")
    assert tok.decode(ids) == "2+2=4<|im_end|>" and _trained_text(tok, ids, trained) == "4<|im_end|>"
    byte = Renderer("instruction", ByteTokenizer(), None, {}, False)         # no template: Alpaca's prompt
    ids, trained = byte.render({"instruction": "Say hi", "input": "", "output": "hi"}, "x")
    text = bytes(ids).decode()
    assert text.startswith("Below is an instruction") and "### Response:\nhi" in text
    assert bytes(i for i, t in zip(ids, trained) if t) == b"hi"
    chat = Renderer("instruction", tok, tok_dir, {}, False)                  # a template: the user/assistant turns
    ids, trained = chat.render({"instruction": "Say hi", "input": "to Bob", "output": "hi Bob"}, "x")
    assert "<|im_start|>user\nSay hi\n\nto Bob<|im_end|>" in tok.decode(ids)
    assert _trained_text(tok, ids, trained) == "hi Bob<|im_end|>\n"


def test_missing_fields_and_bad_lines_name_the_record(tok_dir, tmp_path):
    tok = load_tokenizer(tok_dir)
    with pytest.raises(ValueError, match=r"x: no field 'completion'.*data.fields.completion"):
        Renderer("prompt_completion", tok, None, {}, False).render({"prompt": "p"}, "x")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a"}\n{oops\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not a JSON object"):
        list(read_records([bad]))
    with pytest.raises(ValueError, match="has none"):
        Renderer("chat", ByteTokenizer(), None, {}, False)


def test_jsonl_parquet_and_datasets_give_the_same_rows(tok_dir, tmp_path):
    pytest.importorskip("pyarrow")
    datasets = pytest.importorskip("datasets")
    import pyarrow as pa
    import pyarrow.parquet as pq
    tok = load_tokenizer(tok_dir)
    r = Renderer("chat", tok, tok_dir, {}, False)
    jsonl = _jsonl(tmp_path / "c.jsonl", CHATS)
    pq.write_table(pa.Table.from_pylist(CHATS), tmp_path / "c.parquet")
    datasets.Dataset.from_list(CHATS).save_to_disk(str(tmp_path / "ds"))
    rows = [example_rows(read_records([p]), r, 96, tok.eos_token_id)
            for p in (jsonl, tmp_path / "c.parquet", tmp_path / "ds")]
    for other in rows[1:]:
        assert (other.ids == rows[0].ids).all() and (other.trained == rows[0].trained).all()


def test_batches_are_sharded_resumable_and_reshuffled(tok_dir, tmp_path):
    tok = load_tokenizer(tok_dir)
    rows = example_rows(read_records([_jsonl(tmp_path / "c.jsonl", CHATS)]), Renderer("chat", tok, tok_dir, {},
                        False), 96, tok.eos_token_id)
    one = ExampleBatches(rows, 4, seed=3, val_fraction=0.0)
    whole = [next(one) for _ in range(7)]                       # past the first epoch (12 examples / 4)
    halves = [ExampleBatches(rows, 4, r, 2, seed=3, val_fraction=0.0) for r in range(2)]
    b0, b1 = next(halves[0]), next(halves[1])
    assert torch.equal(torch.cat([b0["input_ids"], b1["input_ids"]]), whole[0]["input_ids"])
    again = ExampleBatches(rows, 4, seed=3, val_fraction=0.0)
    for _ in range(2):
        next(again)
    resumed = ExampleBatches(rows, 4, seed=3, val_fraction=0.0)
    resumed.load_state_dict(again.state_dict())
    for k in range(2, 7):
        b = next(resumed)
        assert torch.equal(b["input_ids"], whole[k]["input_ids"]) and torch.equal(b["labels"], whole[k]["labels"])
    epoch0 = torch.cat([w["input_ids"] for w in whole[:3]])
    epoch1 = torch.cat([w["input_ids"] for w in whole[3:6]])
    assert not torch.equal(epoch0, epoch1)                      # another order in the next epoch
    labels = whole[0]["labels"]
    assert (labels == -100).any() and (labels != -100).any()


@pytest.fixture(scope="module")
def hf_chat_model(tok_dir, tmp_path_factory):
    """A tiny Llama directory with the chat tokenizer and end-of-turn ids: what both packings start from."""
    from bunsan.models import Llama, LlamaConfig
    from bunsan.models.hf import save_llama
    import shutil
    cfg = LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    hf = save_llama(Llama(cfg).state_dict(), cfg, tmp_path_factory.mktemp("sft") / "hf")
    for f in tok_dir.iterdir():
        shutil.copy(f, hf / f.name)
    (hf / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 257], "max_new_tokens": 32}))
    return hf


@pytest.mark.parametrize("packing", [False, True])
def test_train_init_from_lora_chat_end_to_end(pools, hf_chat_model, tmp_path, packing):
    data = _jsonl(tmp_path / "chat.jsonl", CHATS)
    r = pools.cli(1, ["train", "--nproc", "1", "--init-from", hf_chat_model, "--lora", "--data", data, "--format",
                      "chat", "--steps", "3", "--seq-len", "96", "--micro-batch", "2", "--output", tmp_path / "out",
                      "--set", "data.val_fraction=0.2", "--set", f"data.packing={str(packing).lower()}"],
                  cwd=tmp_path)[0]
    assert r.returncode == 0, r.stdout + r.stderr
    assert "12 examples, 12 used" in r.stderr and ("packed into" in r.stderr) == packing
    final = tmp_path / "out" / "final"
    assert (final / "tokenizer.json").is_file()
    # the model's own chat template and end-of-turn ids come along, so serve answers with them
    from bunsan.serve.chat import ChatTemplate
    chat = ChatTemplate(None, final)
    assert chat.source == "the checkpoint's chat template"
    assert chat.text([{"role": "user", "content": "hi"}]) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert {0, 257} <= chat.eos_ids
    assert json.loads((final / "generation_config.json").read_text())["eos_token_id"] == [0, 257]


def test_a_packed_row_computes_each_document_as_if_alone():
    from parity import tiny_model
    from bunsan.models.packing import document_positions
    model = tiny_model(0).eval()
    g = torch.Generator().manual_seed(0)
    a, b = torch.randint(0, 256, (1, 10), generator=g), torch.randint(0, 256, (1, 7), generator=g)
    row = torch.cat([a, b, torch.zeros(1, 3, dtype=torch.long)], 1)
    docs = torch.tensor([[0] * 10 + [1] * 7 + [2] * 3])
    assert document_positions(docs).tolist() == [list(range(10)) + list(range(7)) + [0, 1, 2]]
    with torch.no_grad():
        packed = model(row, documents=docs)
        torch.testing.assert_close(packed[:, :10], model(a), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(packed[:, 10:17], model(b), rtol=1e-5, atol=1e-5)


def test_packing_gives_the_loss_and_gradients_of_one_example_per_row(tok_dir, tmp_path):
    import bunsan
    from parity import tiny_model
    tok = load_tokenizer(tok_dir)
    recs = [{"prompt": "2+2=", "completion": "4"}, {"prompt": "Say hi: ", "completion": "hi there"},
            {"prompt": "x", "completion": "yz"}]
    r = Renderer("prompt_completion", tok, None, {}, False)
    padded = example_rows([(str(i), x) for i, x in enumerate(recs)], r, 40, tok.eos_token_id)
    packed = example_rows([(str(i), x) for i, x in enumerate(recs)], r, 40, tok.eos_token_id, packing=True)
    assert len(packed.ids) == 1 and len(padded.ids) == 3 and int(packed.trained.sum()) == int(padded.trained[:, 1:].sum())
    results = []
    for rows in (padded, packed):
        batches = ExampleBatches(rows, len(rows.ids), seed=0, val_fraction=0.0)
        engine = bunsan.initialize(tiny_model(0, vocab_size=320), {"train_micro_batch_size_per_gpu": len(rows.ids),
                                                   "optimizer": {"type": "SGD", "params": {"lr": 1.0}}})
        loss = engine.train_batch(next(batches))
        results.append((loss, engine.consolidated_state_dict()))
    assert results[0][0] == pytest.approx(results[1][0], rel=1e-5)
    for k, v in results[0][1].items():
        torch.testing.assert_close(results[1][1][k], v, rtol=1e-5, atol=1e-6, msg=k)


def test_two_tokenize_workers_give_the_same_rows(tok_dir, tmp_path):
    tok = load_tokenizer(tok_dir)
    r = Renderer("chat", tok, tok_dir, {}, False)
    records = [(str(i), c) for i, c in enumerate(CHATS)]
    one = example_rows(records, r, 96, tok.eos_token_id)
    two = example_rows(records, r, 96, tok.eos_token_id, workers=2)
    assert (one.ids == two.ids).all() and (one.trained == two.trained).all()
