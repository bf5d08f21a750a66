"""`bunsan serve` on vision-language models (tiny LLaVA: CLIP + Llama; Qwen2-VL and Qwen2.5-VL, their 3D
rotary positions): images in the batcher's paged forward give transformers' own greedy `generate` tokens with
the same pixels, prompts that differ only in their image share no KV block past it (the prefix cache keys an
image's tokens by its content) and the same image's are reused; through the HTTP API, the official openai
client's image_url parts (data: URLs, files under --allowed-local-media-path) and Ollama's `images` answer as
transformers does on the model's own processor output (LLaVA's, Qwen2-VL's and Qwen2.5-VL's), and what cannot be
read is a 400 naming it."""

# Where each is served: the batcher in this process (llava, qwen2_vl, qwen2_5_vl); `bunsan serve` launched as a
# user starts it (e2e), the images launch path kept: LLaVA through the openai client and Ollama's API; loaded by
# the command's own code and served in this process: LLaVA's unreadable images (400s), Qwen2-VL and
# Qwen2.5-VL through the openai client and Ollama, Qwen2-Audio's text and its refused audio (these were each a
# server launched).

from __future__ import annotations

import base64
import io

import pytest
import torch

transformers = pytest.importorskip("transformers")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

from chat_tokenizer import save_chat_tokenizer  # noqa: E402
from serve_harness import CEILING_S, Launched, Server, http_get, http_post, run_until_done, selected  # noqa: E402
from serve_harness import one_torch_thread  # noqa: E402,F401  (autouse: torch on one thread here)
from test_multimodal import END, IMAGE, START, build  # noqa: E402

NEW = 8


def _inputs(kind: str, ids: torch.Tensor, g: torch.Generator) -> dict:
    """A prompt's image as the model's processor lays it out (LLaVA: 16 tokens of a 32x32 image; Qwen2-VL:
    4 merged tokens of 16 flat patches between vision start and end)."""
    if kind == "llava":
        ids[2:18] = IMAGE
        return {"pixel_values": torch.randn(1, 3, 32, 32, generator=g)}
    ids[2], ids[3:7], ids[7] = START, IMAGE, END
    return {"pixel_values": torch.randn(16, 96, generator=g), "image_grid_thw": torch.tensor([[1, 4, 4]]),
            "mm_token_type_ids": (ids == IMAGE).long()[None]}


@pytest.mark.parametrize("kind", ["llava", "qwen2_vl", "qwen2_5_vl"])
def test_images_in_the_paged_batcher_give_transformers_greedy_tokens(kind):
    """Four prompts with one image each, the third the first's text with another image, the fourth the first
    again; the pool holds too few blocks for all at once, so some are preempted and prefilled again."""
    from bunsan.serve.batcher import Batcher, Request
    from bunsan.serve.media import Image, Media, image_keys
    from bunsan.serve.transformers_model import TransformersLM
    hf = build(kind).eval()
    g = torch.Generator().manual_seed(5)
    prompts, inputs = [], []
    for _ in range(2):
        ids = torch.randint(3, IMAGE, (20,), generator=g)
        inputs.append(_inputs(kind, ids, g))
        prompts.append(ids.tolist())
    other = _inputs(kind, torch.tensor(prompts[0]), g)
    prompts, inputs, digests = prompts + [prompts[0], prompts[0]], inputs + [other, inputs[0]], ["a", "b", "c", "a"]
    want = [hf.generate(torch.tensor([p]), **x, max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                        pad_token_id=0)[0, len(p):].tolist() for p, x in zip(prompts, inputs)]
    assert want[2] != want[0]              # the image decides the answer
    batcher = Batcher(TransformersLM(hf), slots=3, max_len=64, block_size=4, num_blocks=16)
    got, finished = [[] for _ in prompts], []
    for i, (p, x, d) in enumerate(zip(prompts, inputs, digests)):
        media = Media(dict(x), image_keys(p, IMAGE, [Image(None, d)]))
        batcher.submit(Request(p, NEW, emit=lambda t, i=i: got[i].append(t.id), finish=finished.append,
                               media=media))
    run_until_done(batcher, finished, len(prompts))
    assert got == want
    assert batcher.preempted > 0 and batcher.reused_tokens > 0


def test_an_image_token_is_keyed_by_its_image():
    from bunsan.serve.media import Image, image_keys
    a, b = Image(None, "a"), Image(None, "b")
    assert image_keys([5, 9, 9, 6, 9, 7], 9, [a, b]) == [5, ("a", 0), ("a", 1), 6, ("b", 0), 7]
    merged = image_keys([5, 9, 9, 9, 9], 9, [a, b])      # adjacent images: keyed by both
    assert merged[0] == 5 and len({k[0] for k in merged[1:]}) == 1 and merged[1] != merged[2]


CHAT = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
        "{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}<image>{% else %}{{ c['text'] }}"
        "{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory):
    """A tiny LLaVA saved as a Hugging Face directory with its processor (CLIP's image processor at 32x32,
    the byte-level tokenizer with <image>, a chat template that places image parts)."""
    folder = tmp_path_factory.mktemp("llava")
    save_chat_tokenizer(folder)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = None
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<image>"]})
    model = build("llava")
    model.config.image_token_index = model.config.image_token_id = tokenizer.convert_tokens_to_ids("<image>")
    model.save_pretrained(folder)
    images = transformers.CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    transformers.LlavaProcessor(image_processor=images, tokenizer=tokenizer, patch_size=8, chat_template=CHAT,
                                vision_feature_select_strategy="default",
                                num_additional_image_tokens=1).save_pretrained(folder)      # (CLIP's CLS)
    return folder


def _png(seed: int) -> bytes:
    from PIL import Image
    g = torch.Generator().manual_seed(seed)
    pixels = (torch.rand(40, 48, 3, generator=g) * 255).to(torch.uint8).numpy()
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def _expected(folder, text: str, png: bytes) -> str:
    """transformers' answer: the processor's prompt and pixels (Qwen2-VL's as its model card calls it, loaded
    without its video processor where torchvision is missing), greedy generate, up to the end of turn."""
    from PIL import Image

    from bunsan.models.processor import load_processor
    processor = load_processor(folder)
    model = transformers.AutoModelForImageTextToText.from_pretrained(folder).eval()
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    batch = processor(text=[prompt], images=[Image.open(io.BytesIO(png)).convert("RGB")], return_tensors="pt",
                      add_special_tokens=False)
    end = processor.tokenizer.convert_tokens_to_ids("<|im_end|>")
    out = model.generate(**batch, max_new_tokens=NEW, do_sample=False, eos_token_id=end, pad_token_id=0)
    new = out[0, batch["input_ids"].shape[1]:].tolist()
    return processor.tokenizer.decode(new[:new.index(end)] if end in new else new)


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    folder = tmp_path_factory.mktemp("media")
    (folder / "one.png").write_bytes(_png(1))
    return folder


def _llava_flags(llava_dir, media) -> list:
    return ["--checkpoint", llava_dir, "--allowed-local-media-path", media, "--served-model-name", "llava",
            "--context", "96"]


@pytest.fixture(scope="module")
def llava_in_process(llava_dir, media):
    server = Server.of_command(*_llava_flags(llava_dir, media))
    yield server.url, media
    server.close()


def _ask(url: str, text: str, image_url: str) -> str:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=CEILING_S)
    reply = client.chat.completions.create(model="llava", temperature=0, max_tokens=NEW, messages=[
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": image_url, "detail": "auto"}},
                                     {"type": "text", "text": text}]}])
    return reply.choices[0].message.content


@pytest.fixture(scope="module", autouse=True)
def llava_launched(request):
    """`bunsan serve` on the LLaVA directory, launched as the module starts when its test is to run (its
    start-up overlaps the tests served in this process)."""
    if not selected(request, "test_openai_image_parts_and_ollama_images_answer_as_transformers"):
        yield None
        return
    flags = _llava_flags(request.getfixturevalue("llava_dir"), request.getfixturevalue("media"))
    server = Launched(*flags, wait=False, what="bunsan serve on a LLaVA directory")
    yield server
    server.close(kill=True)


@pytest.mark.e2e
def test_openai_image_parts_and_ollama_images_answer_as_transformers(llava_launched, llava_dir, media):
    """`bunsan serve` launched on a LLaVA directory (its model's process and HTTP process)."""
    try:
        _llava_answers(llava_dir, llava_launched.ready().url, media)
    finally:
        out = llava_launched.close()
    assert "images: LlavaProcessor" in out, out


def _llava_answers(llava_dir, url: str, media) -> None:
    one, two = _png(1), _png(2)
    want_one, want_two = _expected(llava_dir, "what is", one), _expected(llava_dir, "what is", two)
    assert want_one != want_two
    inline = "data:image/png;base64," + base64.b64encode(one).decode()
    assert _ask(url, "what is", inline) == want_one
    assert _ask(url, "what is", "data:image/png;base64," + base64.b64encode(two).decode()) == want_two
    assert _ask(url, "what is", str(media / "one.png")) == want_one             # a file under the allowed path
    assert _ask(url, "what is", f"file://{media / 'one.png'}") == want_one
    ollama = http_post(url + "/api/chat", timeout=CEILING_S, json={
        "model": "llava", "stream": False, "options": {"temperature": 0, "num_predict": NEW},
        "messages": [{"role": "user", "content": "what is", "images": [base64.b64encode(two).decode()]}]})
    assert ollama.status_code == 200, ollama.text
    assert ollama.json()["message"]["content"] == want_two
    generated = http_post(url + "/api/generate", timeout=CEILING_S, json={
        "model": "llava", "stream": False, "options": {"temperature": 0, "num_predict": NEW}, "prompt": "what is",
        "images": [base64.b64encode(one).decode()]})
    assert generated.status_code == 200, generated.text
    assert generated.json()["response"] == want_one             # its template's user turn, as /api/chat's
    show = http_post(url + "/api/show", json={"model": "llava"}).json()
    assert "vision" in show["capabilities"]
    assert http_get(url + "/health").json()["prefix_tokens_reused"] > 0     # the same image asked again


@pytest.mark.parametrize("image_url, says", [
    ("https://example.com/cat.png", "reads no network URLs"),
    ("data:image/png;base64,!!!", "not valid base64"),
    ("data:text/plain,hello", "not base64 image data"),
    ("data:image/png;base64," + base64.b64encode(b"not a picture").decode(), "not an image PIL can read"),
    ("/etc/passwd", "outside --allowed-local-media-path"),
    ("file:///nowhere/../etc/hosts", "outside --allowed-local-media-path"),
])
def test_an_image_that_cannot_be_read_is_a_400_naming_it(llava_in_process, image_url, says):
    url, media = llava_in_process
    reply = http_post(url + "/v1/chat/completions", timeout=CEILING_S, json={"max_tokens": 4, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image_url",
                                                                      "image_url": {"url": image_url}}]}]})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert says in error["message"] and error["param"] == "messages[0].content[1]", error


def test_a_text_model_refuses_images_by_name():
    from bunsan.models import Llama, LlamaConfig
    torch.manual_seed(0)
    server = Server(Llama(LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=96)))
    try:
        png = "data:image/png;base64," + base64.b64encode(_png(1)).decode()
        reply = server.post({"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": png}}]}]}, "/v1/chat/completions")
        assert reply.status_code == 400 and "takes text only" in reply.json()["error"]["message"], reply.text
        reply = server.post({"model": "tiny", "messages": [{"role": "user", "content": "hi", "images": ["AAAA"]}]},
                            "/api/chat")
        assert reply.status_code == 400 and "takes text only" in reply.json()["error"], reply.text
    finally:
        server.close()


def test_an_audio_language_model_serves_its_text_and_refuses_audio_parts(tmp_path):
    """A Qwen2-Audio directory with its processor (Whisper's feature extractor, no image processor) starts
    (it stopped at start-up: no image processor), answers a text chat as transformers' greedy `generate`
    does, and an audio or image content part is a 400 naming it."""
    save_chat_tokenizer(tmp_path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>"]})
    model = build("qwen2_audio").eval()
    model.save_pretrained(tmp_path)
    transformers.Qwen2AudioProcessor(feature_extractor=transformers.WhisperFeatureExtractor(feature_size=16),
                                     tokenizer=tokenizer).save_pretrained(tmp_path)
    processor = transformers.AutoProcessor.from_pretrained(tmp_path)     # its template: the one served
    text = processor.apply_chat_template([{"role": "user", "content": "hello"}], add_generation_prompt=True,
                                         tokenize=False)
    prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    new = model.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, eos_token_id=end,
                         pad_token_id=0)[0, len(prompt):].tolist()
    new = new[:new.index(end)] if end in new else new
    server = Server.of_command("--checkpoint", tmp_path, "--context", "96")
    try:
        reply = server.post({"max_tokens": NEW, "temperature": 0, "messages": [{"role": "user", "content": "hello"}]},
                            "/v1/chat/completions")
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["message"]["content"] == tokenizer.decode(new)
        for part in ({"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}},
                     {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}):
            refused = server.post({"max_tokens": 2, "messages": [
                {"role": "user", "content": [{"type": "text", "text": "hi"}, part]}]}, "/v1/chat/completions")
            assert refused.status_code == 400, refused.text
            assert refused.json()["error"]["param"] == "messages[0].content[1]"
    finally:
        server.close()
    assert "takes no images" in server.banner and "audio: not served" in server.banner, server.banner


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def qwen2_vl_server(request, tmp_path_factory):
    """`bunsan serve` on a Qwen2-VL (or Qwen2.5-VL) directory as its hub folder holds it (its processor loaded
    without the video processor where torchvision is missing: models/processor.py)."""
    from multimodal_dirs import save_qwen2_vl
    folder = tmp_path_factory.mktemp(request.param)
    save_qwen2_vl(folder, request.param)
    server = Server.of_command("--checkpoint", folder, "--served-model-name", "qwen2-vl", "--context", "160")
    processor = "Qwen2VLProcessor" if request.param == "qwen2_vl" else "Qwen2_5_VLProcessor"
    assert server.banner.startswith(f"images: {processor}"), server.banner
    yield server.url, folder
    server.close()


def test_qwen2_vl_answers_openai_image_parts_and_ollama_images_as_transformers(qwen2_vl_server):
    """Qwen2-VL's and Qwen2.5-VL's flat patches and grid through the HTTP API: the official openai client's
    data: URL image part and Ollama's `images` give transformers' greedy answer on the processor's own output."""
    url, folder = qwen2_vl_server
    one, two = _png(1), _png(2)
    want_one, want_two = _expected(folder, "what is", one), _expected(folder, "what is", two)
    assert want_one != want_two
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=CEILING_S)
    for png, want in ((one, want_one), (two, want_two)):
        reply = client.chat.completions.create(model="qwen2-vl", temperature=0, max_tokens=NEW, messages=[
            {"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(png).decode()}},
                {"type": "text", "text": "what is"}]}])
        assert reply.choices[0].message.content == want
    ollama = http_post(url + "/api/chat", timeout=CEILING_S, json={
        "model": "qwen2-vl", "stream": False, "options": {"temperature": 0, "num_predict": NEW},
        "messages": [{"role": "user", "content": "what is", "images": [base64.b64encode(two).decode()]}]})
    assert ollama.status_code == 200, ollama.text
    assert ollama.json()["message"]["content"] == want_two
