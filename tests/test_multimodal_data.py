"""Multimodal chat records in `bunsan train`: JSONL records as users keep them (HF/OpenAI content parts, data:
and file:// URLs, LLaVA's ShareGPT form, LLaMA-Factory's top-level images), images written by PIL and audio by
wave, rendered through the model's own processor (a tiny LLaVA's, a tiny Qwen2-Audio's, built offline): the ids
and media tensors are the processor's own, the loss only on the assistant's tokens (never an image's or a
clip's); bad records are errors naming the record and the part. End to end, `bunsan train` on 1 and 2
processes (ZeRO-2, a frozen vision tower) equals a plain SGD loop on the same batches (fp32, rtol 1e-5)."""

from __future__ import annotations

import base64
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL")

from bunsan.training.chat_records import BadRecord, Where  # noqa: E402
from bunsan.training.example_batches import example_rows  # noqa: E402
from bunsan.training.examples import Renderer, read_records  # noqa: E402
from bunsan.training.media_batches import example_batches  # noqa: E402
from bunsan.training.tokenizer import load_tokenizer  # noqa: E402
from chat_tokenizer import save_chat_tokenizer  # noqa: E402
from multimodal_dirs import AUDIO_RATE, png_bytes, save_llava, save_qwen2_audio, write_png, write_wav  # noqa: E402

IMAGE_TOKENS = 16


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llava")
    save_llava(folder)
    return folder


@pytest.fixture(scope="module")
def qwen2_audio(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen2_audio")
    save_qwen2_audio(folder)
    return folder


def _jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _rows(folder, data, seq_len: int = 64, **kw):
    tok = load_tokenizer(folder)
    renderer = Renderer("chat", tok, folder, {}, False, seq_len=seq_len, **kw)
    return tok, renderer, example_rows(read_records([data], kw.get("on_bad_record", "error")), renderer, seq_len,
                                       tok.eos_token_id)


def _asked(text: str, image_part: dict) -> dict:
    return {"messages": [{"role": "user", "content": [image_part, {"type": "text", "text": text}]},
                         {"role": "assistant", "content": "It is 3."}]}


def _processors_own(folder, messages, **media):
    """What the model's processor makes of the conversation, as its model card says to call it."""
    processor = transformers.AutoProcessor.from_pretrained(folder)
    text = processor.apply_chat_template(messages, tokenize=False)
    return processor(text=[text], return_tensors="pt", add_special_tokens=False, **media)


def test_an_image_record_is_the_processors_batch_with_only_the_answer_trained(llava, tmp_path):
    from PIL import Image
    write_png(tmp_path / "cat.png", 1)
    data = _jsonl(tmp_path / "mm.jsonl", [_asked("What is it?", {"type": "image", "image": "cat.png"})] * 2)
    tok, _, rows = _rows(llava, data)
    batch = example_batches(rows, 2, seed=0, val_fraction=0.0).batch_at(0)
    want = _processors_own(llava, [{"role": "user", "content": [{"type": "image"}, {"type": "text",
                                                                                   "text": "What is it?"}]},
                                   {"role": "assistant", "content": "It is 3."}],
                           images=[Image.open(tmp_path / "cat.png")])
    ids = want["input_ids"][0]
    n = len(ids)
    assert torch.equal(batch["input_ids"][0, :n - 1], ids[:-1])
    assert torch.equal(batch["pixel_values"], torch.cat([want["pixel_values"]] * 2))     # one image per row
    assert list(batch["pixel_values"].shape) == [2, 3, 32, 32]
    labels = batch["labels"][0]
    trained = labels != -100
    assert torch.equal(labels[trained], ids[1:][trained[:n - 1]])                          # the ids themselves
    assert tok.decode(labels[trained].tolist()) == "It is 3.<|im_end|>\n"                  # the answer alone
    image = ids == llava_image_id(llava)
    assert int(image.sum()) == IMAGE_TOKENS and not trained[:n - 1][image[1:]].any()
    assert not trained[n - 1:].any()                                                       # padding


def llava_image_id(folder) -> int:
    return transformers.AutoConfig.from_pretrained(folder).image_token_id


def test_every_way_users_keep_an_image_gives_the_same_row(llava, tmp_path):
    (tmp_path / "img").mkdir()
    write_png(tmp_path / "img" / "cat.png", 1)
    inline = "data:image/png;base64," + base64.b64encode(png_bytes(1)).decode()
    records = [
        _asked("What is it?", {"type": "image", "image": "img/cat.png"}),                        # HF, relative
        _asked("What is it?", {"type": "image_url", "image_url": {"url": inline}}),              # OpenAI, inline
        _asked("What is it?", {"type": "image_url", "image_url": {"url": f"file://{tmp_path}/img/cat.png"}}),
        {"image": "img/cat.png", "conversations": [{"from": "human", "value": "<image>What is it?"},   # LLaVA's
                                                   {"from": "gpt", "value": "It is 3."}]},
        {"images": ["img/cat.png"], "messages": [{"role": "user", "content": "<image>What is it?"},   # LLaMA-Factory
                                                 {"role": "assistant", "content": "It is 3."}]},
    ]
    _, _, rows = _rows(llava, _jsonl(tmp_path / "mm.jsonl", records))
    batch = example_batches(rows, len(records), seed=0, val_fraction=0.0)
    picked = batch.window_ids(0)
    b = batch.batch_at(0)
    first = int((torch.from_numpy(picked) == 0).nonzero()[0])
    for r in range(len(records)):
        assert torch.equal(b["input_ids"][r], b["input_ids"][first]), records[picked[r]]
        assert torch.equal(b["labels"][r], b["labels"][first])
        assert torch.equal(b["pixel_values"][r], b["pixel_values"][first])


def test_an_audio_record_is_qwen2_audios_batch_with_only_the_answer_trained(qwen2_audio, tmp_path):
    samples = write_wav(tmp_path / "a.wav", 1, seconds=0.5)
    stereo = write_wav(tmp_path / "b.wav", 2, seconds=0.75, channels=2)
    records = [{"messages": [{"role": "user", "content": [{"type": "audio", "audio": name},
                                                          {"type": "text", "text": "What is that sound?"}]},
                             {"role": "assistant", "content": "Noise."}]} for name in ("a.wav", "b.wav")]
    tok, _, rows = _rows(qwen2_audio, _jsonl(tmp_path / "au.jsonl", records), seq_len=128)
    batches = example_batches(rows, 2, seed=0, val_fraction=0.0)
    picked, batch = batches.window_ids(0), batches.batch_at(0)
    audio_id = transformers.AutoConfig.from_pretrained(qwen2_audio).audio_token_id
    for row, i in enumerate(picked):
        want = _processors_own(qwen2_audio, [{"role": "user", "content": [{"type": "audio"}, {"type": "text",
                                                                          "text": "What is that sound?"}]},
                                             {"role": "assistant", "content": "Noise."}],
                               audio=[(samples, stereo)[i]], sampling_rate=AUDIO_RATE)
        ids, n = want["input_ids"][0], len(want["input_ids"][0])
        assert torch.equal(batch["input_ids"][row, :n - 1], ids[:-1])
        assert torch.equal(batch["input_features"][row], want["input_features"][0])
        assert torch.equal(batch["feature_attention_mask"][row], want["feature_attention_mask"][0])
        labels = batch["labels"][row]
        assert tok.decode(labels[labels != -100].tolist()) == "Noise.<|im_end|>\n"
        audio = ids == audio_id
        assert int(audio.sum()) == (4, 6)[i] and (labels[:n - 1][audio[1:]] == -100).all()   # 16 and 24 frames
    assert "mm_token_type_ids" in batch     # (the model's forward names none: bunsan train leaves it out)


def _user(*parts) -> dict:
    return {"messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "What?"}]},
                         {"role": "assistant", "content": "That."}]}


IMG = {"type": "image", "image": "ok.png"}
BAD = {
    "missing file": (_user({"type": "image", "image": "nope.png"}),
                     r"mm.jsonl:1: message 0 part 0 \(image\): image file 'nope.png' not found \(looked at .*nope.png\)"),
    "network URL": (_user({"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}),
                    r"mm.jsonl:1: message 0 part 0 \(image_url\): 'https://example.com/cat.png' is a network URL"),
    "not an image": (_user({"type": "image", "image": "text.png"}),
                     r"mm.jsonl:1: message 0 part 0 \(image\): .*text.png is not an image PIL can read"),
    "audio on a vision model": (_user({"type": "audio", "audio": "a.wav"}),
                                r"mm.jsonl:1: message 0 part 0 \(audio\) is audio, and .*\(LlavaProcessor\) reads "
                                "images only"),
    "two images, one per row": (_user(IMG, IMG), r"mm.jsonl:1: 2 images in one record; LlavaProcessor gives one "
                                                 "tensor entry per image"),
    "video": (_user({"type": "video", "video": "v.mp4"}), r"mm.jsonl:1: message 0 part 0 \(video\) is a video"),
    "markers and files disagree": ({"images": ["ok.png"], "conversations": [
        {"from": "human", "value": "<image><image>What?"}, {"from": "gpt", "value": "That."}]},
        r"mm.jsonl:1: 2 <image> marker\(s\) in the text but 1 file\(s\) in 'images'"),
    "bad base64": (_user({"type": "image_url", "image_url": {"url": "data:image/png;base64,!!"}}),
                   r"message 0 part 0 \(image_url\): the data: URL's payload is not valid base64"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_record_is_an_error_naming_the_record_and_part(llava, tmp_path, case):
    record, says = BAD[case]
    write_png(tmp_path / "ok.png", 1)
    (tmp_path / "text.png").write_text("not a picture")
    write_wav(tmp_path / "a.wav", 1)
    with pytest.raises(BadRecord, match=says):
        _rows(llava, _jsonl(tmp_path / "mm.jsonl", [record]))


def test_an_image_on_a_text_only_model_is_an_error(tmp_path):
    save_chat_tokenizer(tmp_path / "tok")
    write_png(tmp_path / "ok.png", 1)
    with pytest.raises(BadRecord, match=r"mm.jsonl:1: message 0 part 0 is image \(image\), and the tokenizer's "
                                        r"folder has no processor that reads images or audio \(a text-only model\)"):
        _rows(tmp_path / "tok", _jsonl(tmp_path / "mm.jsonl", [_user(IMG)]))


def test_rows_a_batch_cannot_be_cut_into_are_refused(llava, tmp_path):
    write_png(tmp_path / "ok.png", 1)
    plain = {"messages": [{"role": "user", "content": "What?"}, {"role": "assistant", "content": "That."}]}
    with pytest.raises(ValueError, match=r"some records have an image \(.*mm.jsonl:1\) and some none "
                                         r"\(.*mm.jsonl:2\): LlavaProcessor gives one tensor entry per image"):
        _rows(llava, _jsonl(tmp_path / "mm.jsonl", [_user(IMG), plain]))
    long = _user({"type": "text", "text": "x" * 40}, IMG)          # the image past data.seq_len + 1 tokens
    with pytest.raises(BadRecord, match=r"mm.jsonl:1: .* data.seq_len \+ 1 = 33 would cut the media's tokens"):
        _rows(llava, _jsonl(tmp_path / "mm.jsonl", [long]), seq_len=32)
    chatty = {"messages": [_user(IMG)["messages"][0], {"role": "assistant", "content": "y" * 80}]}
    _, _, rows = _rows(llava, _jsonl(tmp_path / "mm.jsonl", [chatty]))
    assert rows.cut == 1 and rows.trained[0].sum() > 20              # text after the image may be cut
    batch = example_batches(rows, 1, seed=0, val_fraction=0.0).batch_at(0)
    assert batch["input_ids"].shape == batch["mm_token_type_ids"].shape == (1, 64)


def test_bad_records_are_skipped_and_counted(llava, tmp_path):
    write_png(tmp_path / "ok.png", 1)
    records = [_user(IMG), _user({"type": "image", "image": "nope.png"}), _user(IMG)]
    _, _, rows = _rows(llava, _jsonl(tmp_path / "mm.jsonl", records), on_bad_record="skip")
    assert rows.examples == 2 and len(rows.skipped) == 1 and "nope.png" in rows.skipped[0]
    assert [spec.where.split(":")[-1] for spec in rows.media] == ["1", "3"]


def test_audio_the_extractor_would_cut_or_resample_is_refused(qwen2_audio, tmp_path):
    write_wav(tmp_path / "slow.wav", 1, rate=AUDIO_RATE // 2)
    write_wav(tmp_path / "long.wav", 1, seconds=1.5)
    for name, says in (("slow.wav", r"slow.wav is sampled at 1600 Hz and the model's feature extractor reads "
                                    "3200 Hz"),
                       ("long.wav", r"long.wav is 1.50 s, and the model's feature extractor reads at most 1.00 s")):
        record = {"messages": [{"role": "user", "content": [{"type": "audio", "audio": name}]},
                               {"role": "assistant", "content": "Noise."}]}
        with pytest.raises(BadRecord, match=r"au.jsonl:1: message 0 part 0 \(audio\): .*" + says):
            _rows(qwen2_audio, _jsonl(tmp_path / "au.jsonl", [record]), seq_len=128)
    with pytest.raises(BadRecord, match=r"au.jsonl:1: message 0 part 0 \(image\) is image, and .*\(Qwen2AudioProcessor\) "
                                        "reads audio only"):
        write_png(tmp_path / "ok.png", 1)
        _rows(qwen2_audio, _jsonl(tmp_path / "au.jsonl", [_user(IMG)]), seq_len=128)


def test_freeze_patterns_name_modules_or_globs():
    from bunsan.training.freeze import freeze
    model = transformers.AutoModelForImageTextToText.from_config(transformers.LlavaConfig(
        text_config=transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                             num_attention_heads=2, num_key_value_heads=2),
        vision_config=transformers.CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                                    num_attention_heads=2, image_size=16, patch_size=8)))
    names = {n for n, _ in model.named_parameters()}
    freeze(model, ["vision_tower", "*.bias"])
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen == {n for n in names if ".vision_tower." in f".{n}" or n.endswith(".bias")}
    assert any(n.startswith("model.multi_modal_projector") and n.endswith("weight") for n in names - frozen)
    with pytest.raises(ValueError, match=r"train.freeze pattern 'visual' matches no parameter of the model; its "
                                         r"parameters are named like \['lm_head.weight', 'model.language_model"):
        freeze(model, ["visual"])
    with pytest.raises(ValueError, match="freezes every parameter"):
        freeze(model, ["*"])


STEPS, BATCH, LR, SEQ = 3, 4, 0.1, 64


def _records(folder, n: int = 8) -> list[dict]:
    """n records, each its own image and answer: HF parts, OpenAI image_url and LLaVA's form, alternately."""
    out = []
    for i in range(n):
        write_png(folder / f"{i}.png", i)
        ask, answer = f"What is picture {i}?", f"Picture {i} is noise {i * 7 % 5}."
        if i % 3 == 2:
            out.append({"image": f"{i}.png", "conversations": [{"from": "human", "value": f"<image>\n{ask}"},
                                                               {"from": "gpt", "value": answer}]})
        else:
            out.append(parts_record(f"{i}.png", ask, answer, url=i % 3 != 0))
    return out


def parts_record(image: str, ask: str, answer: str, url: bool) -> dict:
    """A chat record asking about `image` as an HF image part, or (`url`) as OpenAI's image_url part."""
    part = {"type": "image_url", "image_url": {"url": image}} if url else {"type": "image", "image": image}
    return {"messages": [{"role": "user", "content": [part, {"type": "text", "text": ask}]},
                         {"role": "assistant", "content": answer}]}


def plain_loop(model_dir, data, frozen: list[str], seed: int, seq_len: int = SEQ):
    """transformers' model on the same batches (bunsan's rows, order and media), SGD without clipping in fp32:
    the loss the mean over the global batch's trained tokens."""
    from bunsan.engine.batch import keyword_inputs
    from bunsan.training.freeze import freeze
    from bunsan.training.media_batches import takes_inputs
    model = transformers.AutoModelForMultimodalLM.from_pretrained(model_dir, dtype=torch.float32)
    freeze(model, frozen)
    _, _, rows = _rows(model_dir, data, seq_len)
    batches = example_batches(rows, BATCH, seed=seed, val_fraction=0.0)
    takes_inputs(keyword_inputs(model), batches)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    losses = []
    for _ in range(STEPS):
        batch = next(batches)
        labels = batch.pop("labels")
        logits = model(**batch).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def bunsan_train(pools, model_dir, data, out, nproc: int, frozen: list[str], seq_len: int = SEQ, seed: int = 7):
    from safetensors.torch import load_file
    config = {"train_batch_size": BATCH, "train_micro_batch_size_per_gpu": 2, "steps_per_print": 1,
              "optimizer": {"type": "SGD", "params": {"lr": LR}}, "zero_optimization": {"stage": 2},
              "train": {"steps": STEPS, "init_from": str(model_dir), "seed": seed, "output_dir": str(out),
                        "freeze": frozen},
              "data": {"format": "chat", "paths": [str(data)], "seq_len": seq_len, "val_fraction": 0}}
    (out.parent / f"{out.name}.json").write_text(json.dumps(config))
    ranks = pools.cli(nproc, ["train", out.parent / f"{out.name}.json", "--nproc", nproc])
    assert [r.returncode for r in ranks] == [0] * nproc, ranks
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()
              if "loss" in json.loads(line)]
    return losses, load_file(out / "final" / "model.safetensors"), "".join(r.stderr for r in ranks)


FROZEN = ["vision_tower"]


@pytest.fixture(scope="module")
def image_records(llava, tmp_path_factory):
    """The image records and the plain loop's (losses, state) on them: one reference for both process counts."""
    folder = tmp_path_factory.mktemp("image-records")
    data = _jsonl(folder / "mm.jsonl", _records(folder))
    return data, plain_loop(llava, data, FROZEN, seed=7)


@pytest.mark.parametrize("nproc", [1, 2])
def test_bunsan_train_on_image_records_equals_the_plain_loop(pools, llava, image_records, tmp_path, nproc):
    """ZeRO-2 with 2 rows a micro-batch: one process accumulates two, two processes take one each."""
    data, (want_losses, want) = image_records
    losses, state, log = bunsan_train(pools, llava, data, tmp_path / "out", nproc, FROZEN)
    assert "8 examples, 8 used" in log
    saved = {p.name for p in (tmp_path / "out" / "final").iterdir()}
    processor = {p.name for p in llava.iterdir() if "processor" in p.name}
    assert processor and processor <= saved          # bunsan serve reads images with it
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), rtol=1e-5, atol=0)
    assert want_losses[-1] < want_losses[0]
    assert set(state) == set(want)
    before = transformers.AutoModelForMultimodalLM.from_pretrained(llava).state_dict()
    for name, value in want.items():
        torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6, msg=name)
        if "vision_tower" in name:
            assert torch.equal(state[name], before[name]), name          # frozen: as it was
        elif "multi_modal_projector" in name and name.endswith("weight"):
            assert not torch.equal(state[name], before[name]), name      # trained


def test_bunsan_train_on_audio_records_equals_the_plain_loop(pools, qwen2_audio, tmp_path):
    records = []
    for i in range(8):
        write_wav(tmp_path / f"{i}.wav", i, seconds=0.25 + 0.1 * i)
        records.append({"messages": [{"role": "system", "content": "Listen."},
                                     {"role": "user", "content": [{"type": "audio", "audio": f"{i}.wav"},
                                                                  {"type": "text", "text": "Which?"}]},
                                     {"role": "assistant", "content": f"Clip {i}."}]})
    data = _jsonl(tmp_path / "au.jsonl", records)
    losses, state, _ = bunsan_train(pools, qwen2_audio, data, tmp_path / "out", 1, [], seq_len=80)
    want_losses, want = plain_loop(qwen2_audio, data, [], seed=7, seq_len=80)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), rtol=1e-5, atol=0)
    for name, value in want.items():
        torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_the_mask_follows_the_tokens_the_processor_keeps(llava, tmp_path):
    """Placeholders written out (LLaVA's, Qwen's), or with the text around them retokenized (Gemma 3 writes
    "\\n\\n" around an image): the trained tokens keep their mask; a trained token changed is an error."""
    media = Renderer("chat", load_tokenizer(llava), llava, {}, False).media
    P = llava_image_id(llava)
    plain, marks = [1, 2, P, 3, 4, 5], [False, False, False, False, True, True]
    assert media._aligned(plain, marks, [1, 2, P, P, P, 3, 4, 5], "x") == [False] * 6 + [True, True]
    merged = [1, 9, 8, P, P, 8, 3, 4, 5]                      # 2 merged into 9 by the tokens written around P
    assert media._aligned(plain, marks, merged, "x") == [False] * 7 + [True, True]
    with pytest.raises(BadRecord, match=r"x: the processor changed trained tokens \(\[4\] became \[7\]\)"):
        media._aligned(plain, marks, [1, 2, P, P, 3, 7, 5], "x")
    assert media._aligned([P, 4], [True, True], [P, P, 4], "x") == [False, False, True]   # never a placeholder
    write_png(tmp_path / "ok.png", 1)
    everything = Renderer("chat", load_tokenizer(llava), llava, {}, True)        # data.train_on_prompt
    ids, trained, _ = everything.render(_user(IMG), Where("x", tmp_path))       # (read_records' where)
    assert trained == [i != P for i in ids] and ids.count(P) == IMAGE_TOKENS


def test_text_records_mask_as_text_chat_and_sharegpt_is_read_as_messages(llava, tmp_path):
    """The processor's path gives a text-only conversation text chat's ids and mask (the same template), and
    ShareGPT's conversations are the messages they say, with or without a processor."""
    chat = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Add 2 and 1"},
                         {"role": "assistant", "content": "It is 3."}, {"role": "user", "content": "Thanks"},
                         {"role": "assistant", "content": "Welcome!"}]}
    sharegpt = {"conversations": [{"from": {"user": "human", "assistant": "gpt"}.get(m["role"], m["role"]),
                                   "value": m["content"]} for m in chat["messages"]]}
    renderer = Renderer("chat", load_tokenizer(llava), llava, {}, False)
    ids, trained, _ = renderer.render(chat, "x")
    assert (ids, trained) == renderer._chat(chat["messages"], "x")
    assert renderer.render(sharegpt, "x")[:2] == (ids, trained)
    save_chat_tokenizer(tmp_path / "tok")
    text = Renderer("chat", load_tokenizer(tmp_path / "tok"), tmp_path / "tok", {}, False)
    assert text.media is None and text.render(sharegpt, "x") == text.render(chat, "x")
