"""Multimodal chat records for a processor with grids, a tiny Qwen2-VL's (tests/multimodal_dirs.py): its image
processor lays every image's patches flat ([patches, dim]) with a grid per image (image_grid_thw), and an image
of any size gives grid.prod() patches and a quarter as many <|image_pad|> tokens. A record is the processor's own
batch, the loss only on the assistant's tokens; records of different image sizes, two images or none share one
batch, their patches in row order, cut by row with their images (engine/media.py), each row's logits its own;
`bunsan train` on 1 and 2 processes (ZeRO-2) equals the plain SGD loop on the same batches (fp32, rtol 1e-5).
Without torchvision (as here), transformers cannot build Qwen2-VL's video processor, so AutoProcessor fails: bunsan
loads the processor without it (models/processor.py). The rest of the records' forms, bad records and LLaVA's
and Qwen2-Audio's: tests/test_multimodal_data.py, whose helpers these tests use."""

from __future__ import annotations

import importlib.util
import pickle

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL")

from bunsan.models.processor import load_processor  # noqa: E402
from bunsan.training.media_batches import example_batches  # noqa: E402
from multimodal_dirs import QWEN2_VL_MERGE, save_qwen2_vl, write_png  # noqa: E402
from test_multimodal_data import _jsonl, _rows, bunsan_train, parts_record, plain_loop  # noqa: E402

SEQ = 160                    # Qwen2-VL's template writes a system turn of 38 tokens (a byte-level tokenizer)
SMALL = (16, 24)             # kept as it is: 4x6 patches, 6 tokens; write_png's 40x48 is cut to 24x32: 12 tokens
NO_TORCHVISION = importlib.util.find_spec("torchvision") is None


@pytest.fixture(scope="module")
def qwen2_vl(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen2_vl")
    save_qwen2_vl(folder)
    return folder


def _ask(*images: str, text: str = "What is it?", answer: str = "It is 3.") -> dict:
    return {"messages": [{"role": "user", "content": [*({"type": "image", "image": i} for i in images),
                                                      {"type": "text", "text": text}]},
                         {"role": "assistant", "content": answer}]}


def _own(folder, record: dict, tmp_path) -> dict:
    """What Qwen2-VL's processor makes of the record, as its model card says to call it."""
    from PIL import Image
    processor = load_processor(folder)
    messages = [{**m, "content": [{"type": "image"} if c["type"] == "image" else c for c in m["content"]]}
                if isinstance(m["content"], list) else m for m in record["messages"]]
    images = [Image.open(tmp_path / c["image"]) for m in record["messages"] if isinstance(m["content"], list)
              for c in m["content"] if c["type"] == "image"]
    text = processor.apply_chat_template(messages, tokenize=False)
    return dict(processor(text=[text], images=images or None, return_tensors="pt", add_special_tokens=False))


def _image_id(folder) -> int:
    return transformers.AutoConfig.from_pretrained(folder).image_token_id


@pytest.mark.skipif(not NO_TORCHVISION, reason="transformers builds the video processor with torchvision")
def test_qwen2_vls_processor_loads_without_its_video_processor(qwen2_vl):
    """transformers' AutoProcessor needs torchvision for Qwen2-VL's video processor; bunsan's loader gives the
    model's own Qwen2VLProcessor with PIL's image processor, refuses videos by name, and pickles."""
    with pytest.raises(ImportError, match="Qwen2VLVideoProcessor requires the Torchvision library"):
        transformers.AutoProcessor.from_pretrained(qwen2_vl)
    processor = load_processor(qwen2_vl)
    assert isinstance(processor, transformers.Qwen2VLProcessor) and type(processor).__name__ == "Qwen2VLProcessor"
    assert type(processor.image_processor).__name__ == "Qwen2VLImageProcessorPil"
    assert getattr(processor, "video_processor", None) is None
    assert {"pixel_values", "image_grid_thw", "mm_token_type_ids"} <= set(processor.model_input_names)
    with pytest.raises(ValueError, match=r"Qwen2VLProcessor was loaded without its video processor .*torchvision"):
        processor(text=["<|video_pad|>"], videos=[np.zeros((2, 8, 8, 3), dtype=np.uint8)])
    again = pickle.loads(pickle.dumps(processor))       # (data.tokenize_workers' processes get the renderer)
    assert type(again) is type(processor) and again.image_processor.to_dict() == processor.image_processor.to_dict()


def test_bunsan_serve_lays_out_a_qwen2_vl_image_with_the_same_processor(qwen2_vl, tmp_path):
    """bunsan serve loads the processor the same way (no torchvision): the prompt's image as 12 tokens and the
    image processor's patches with their grid."""
    from PIL import Image
    from bunsan.serve.media import Image as Served, ImageReader, VisionInputs
    write_png(tmp_path / "cat.png", 1)
    vision = VisionInputs(qwen2_vl, ImageReader(), _image_id(qwen2_vl))
    ids, media = vision.layout("<|vision_start|><|image_pad|><|vision_end|>What?",
                               [Served(Image.open(tmp_path / "cat.png"), "a")])
    assert ids.count(_image_id(qwen2_vl)) == 12 and media.inputs["image_grid_thw"].tolist() == [[1, 6, 8]]
    patches = transformers.AutoImageProcessor.from_pretrained(qwen2_vl)([Image.open(tmp_path / "cat.png")],
                                                                       return_tensors="pt")["pixel_values"]
    assert torch.equal(media.inputs["pixel_values"], patches)


def test_a_qwen2_vl_image_record_is_the_processors_batch_with_only_the_answer_trained(qwen2_vl, tmp_path):
    write_png(tmp_path / "cat.png", 1)
    record = _ask("cat.png")
    tok, _, rows = _rows(qwen2_vl, _jsonl(tmp_path / "mm.jsonl", [record]), SEQ)
    batch = example_batches(rows, 1, seed=0, val_fraction=0.0).batch_at(0)
    want = _own(qwen2_vl, record, tmp_path)
    ids, n = want["input_ids"][0], len(want["input_ids"][0])
    assert torch.equal(batch["input_ids"][0, :n - 1], ids[:-1])
    assert torch.equal(batch["pixel_values"], want["pixel_values"])                  # flat: [patches, 3*2*4*4]
    assert torch.equal(batch["image_grid_thw"], want["image_grid_thw"])
    assert batch["image_grid_thw"].tolist() == [[1, 6, 8]] and list(batch["pixel_values"].shape) == [48, 96]
    assert torch.equal(batch["mm_token_type_ids"][0, :n], want["mm_token_type_ids"][0])
    # the processor's work redone by hand: the image processor's patches and <|image_pad|> written out
    from PIL import Image
    images = transformers.AutoImageProcessor.from_pretrained(qwen2_vl)(
        [Image.open(tmp_path / "cat.png")], return_tensors="pt")
    assert torch.equal(images["pixel_values"], batch["pixel_values"])
    text = tok.decode(ids.tolist())
    assert text.count("<|image_pad|>") == 48 // QWEN2_VL_MERGE ** 2
    assert "<|vision_start|>" + "<|image_pad|>" * 12 + "<|vision_end|>What is it?<|im_end|>" in text
    labels = batch["labels"][0]
    trained = labels != -100
    assert torch.equal(labels[trained], ids[1:][trained[:n - 1]])
    assert tok.decode(labels[trained].tolist()) == "It is 3.<|im_end|>\n"             # not the system turn
    image = ids == _image_id(qwen2_vl)
    assert int(image.sum()) == 12 and not trained[:n - 1][image[1:]].any()
    assert not trained[n - 1:].any()


def test_images_of_different_sizes_two_or_none_share_a_batch_cut_by_row(qwen2_vl, tmp_path):
    """Four rows: a 40x48 image, a 16x24 one, both, none. The batch's patches are the rows' own in row order
    (the grids say how many), each row's image tokens a quarter of its patches; cut into 2 or 4 micro-batches
    (engine/media.py) each piece holds its rows' patches; and the model's logits for each row of the batch are
    the row's own, processed alone."""
    from bunsan.engine.media import check_rows, split_media
    write_png(tmp_path / "big.png", 1)
    write_png(tmp_path / "small.png", 2, size=SMALL)
    records = [_ask("big.png"), _ask("small.png"), _ask("big.png", "small.png", text="Which is bigger?"),
               {"messages": [{"role": "user", "content": "No picture."}, {"role": "assistant", "content": "Fine."}]}]
    _, _, rows = _rows(qwen2_vl, _jsonl(tmp_path / "mm.jsonl", records), SEQ)
    batches = example_batches(rows, 4, seed=0, val_fraction=0.0)
    picked, batch = batches.window_ids(0).tolist(), batches.batch_at(0)
    check_rows(batch)
    grids = {0: [[1, 6, 8]], 1: [[1, 4, 6]], 2: [[1, 6, 8], [1, 4, 6]], 3: []}
    assert batch["image_grid_thw"].tolist() == [g for i in picked for g in grids[i]]
    assert batch["pixel_values"].shape[0] == int(batch["image_grid_thw"].prod(-1).sum()) == 2 * (48 + 24)
    own = [_own(qwen2_vl, records[i], tmp_path) for i in picked]
    assert torch.equal(batch["pixel_values"], torch.cat([o["pixel_values"] for o in own if "pixel_values" in o]))
    image_id = _image_id(qwen2_vl)
    for row, i in enumerate(picked):
        tokens = int((batch["input_ids"][row] == image_id).sum())
        assert tokens == sum(t * h * w for t, h, w in grids[i]) // QWEN2_VL_MERGE ** 2
        assert int(batch["mm_token_type_ids"][row].sum()) == tokens
    for pieces in (2, 4):
        for k, piece in enumerate(split_media(batch, pieces)):
            mine = own[k * 4 // pieces:(k + 1) * 4 // pieces]
            patches = [o["pixel_values"] for o in mine if "pixel_values" in o]
            assert ("pixel_values" in piece) == bool(patches)
            if patches:
                assert torch.equal(piece["pixel_values"], torch.cat(patches))
                assert torch.equal(piece["image_grid_thw"], torch.cat([o["image_grid_thw"] for o in mine
                                                                       if "image_grid_thw" in o]))
    model = transformers.AutoModelForMultimodalLM.from_pretrained(qwen2_vl, dtype=torch.float32).eval()
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    with torch.no_grad():
        together = model(**inputs).logits
        for row, o in enumerate(own):
            n = o["input_ids"].shape[1]
            alone = model(**{k: v for k, v in o.items() if k != "attention_mask"}).logits
            torch.testing.assert_close(together[row, :n - 1], alone[0, :n - 1], rtol=1e-5, atol=1e-5)


def _vl_records(folder) -> list[dict]:
    """8 records: images of two sizes, in HF parts, OpenAI image_url and LLaMA-Factory's top-level images with
    <image> markers; one record with two images, one with none."""
    out = []
    for i in range(8):
        write_png(folder / f"{i}.png", i, size=SMALL if i % 2 else (40, 48))
        ask, answer = f"What is picture {i}?", f"Picture {i} is noise {i * 7 % 5}."
        if i == 5:
            out.append(_ask("4.png", f"{i}.png", text=ask, answer=answer))
        elif i == 6:
            out.append({"messages": [{"role": "user", "content": ask}, {"role": "assistant", "content": answer}]})
        elif i % 3 == 2:
            out.append({"images": [f"{i}.png"], "messages": [{"role": "user", "content": f"<image>{ask}"},
                                                              {"role": "assistant", "content": answer}]})
        else:
            out.append(parts_record(f"{i}.png", ask, answer, url=i % 3 != 0))
    return out


@pytest.mark.parametrize("nproc", [1, 2])
def test_bunsan_train_on_qwen2_vl_image_records_equals_the_plain_loop(pools, qwen2_vl, tmp_path, nproc):
    """ZeRO-2 with 2 rows a micro-batch: one process accumulates two, two processes take one each; every weight
    trains, the vision tower's too (its gradient comes through each row's own patches)."""
    data = _jsonl(tmp_path / "mm.jsonl", _vl_records(tmp_path))
    losses, state, log = bunsan_train(pools, qwen2_vl, data, tmp_path / "out", nproc, [], seq_len=SEQ)
    assert "8 examples, 8 used" in log
    saved = {p.name for p in (tmp_path / "out" / "final").iterdir()}
    assert {"preprocessor_config.json", "chat_template.jinja"} <= saved       # bunsan serve reads images with it
    want_losses, want = plain_loop(qwen2_vl, data, [], seed=7, seq_len=SEQ)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), rtol=1e-5, atol=0)
    assert want_losses[-1] < want_losses[0]
    assert set(state) == set(want)
    before = transformers.AutoModelForMultimodalLM.from_pretrained(qwen2_vl).state_dict()
    for name, value in want.items():
        torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6, msg=name)
    tower = "model.visual.patch_embed.proj.weight"
    assert not torch.equal(state[tower], before[tower])                     # trained through the patches
