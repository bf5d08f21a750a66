"""Tiny vision- and audio-language model directories as Hugging Face saves them, built here without downloads:
a byte-level tokenizer with the model's special tokens, its image processor or feature extractor, a chat
template, the processor (save_pretrained; Qwen2-VL's files as its hub folder holds them: transformers cannot
build its processor without torchvision) and random weights. What `bunsan train --init-from` and the
multimodal chat records of tests/test_multimodal_data.py are fed; media files written as users have them (PNG
by PIL, WAV by the standard library's wave)."""

from __future__ import annotations

import io
import wave

import numpy as np
import torch

from chat_tokenizer import save_chat_tokenizer

TEXT = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)
# LLaVA's: an image part is <image>, which its processor writes out as the image's 16 tokens
LLAVA_CHAT = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
              "{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}<image>{% else %}{{ c['text'] }}"
              "{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Qwen2-VL-Instruct's own template: each image part is <|vision_start|><|image_pad|><|vision_end|> (the processor
# writes <|image_pad|> out as one token per 2x2 merged patches), a default system turn when none is given
QWEN2_VL_CHAT = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}"
    "<|im_end|>\n{% else %}{% for content in message['content'] %}{% if content['type'] == 'image' or 'image' in "
    "content or 'image_url' in content %}{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}"
    "Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>{% elif content['type'] "
    "== 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}"
    "Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>{% elif 'text' in content "
    "%}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}"
    "<|im_start|>assistant\n{% endif %}")
QWEN2_VL_PATCH, QWEN2_VL_MERGE = 4, 2      # an image is resized to multiples of 8 pixels, 4x4 patches, 2x2 merged
AUDIO_RATE = 3200        # the feature extractor's: 32 frames a second, at most 1 s (the tiny encoder's 32 frames)


def _tokenizer(folder, specials: list[str]):
    import transformers
    save_chat_tokenizer(folder)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", *specials]})
    return tokenizer


def save_llava(folder) -> None:
    """CLIP (32x32 images, 8x8 patches: 16 image tokens) + a 2-layer Llama, with LlavaProcessor."""
    import transformers
    tokenizer = _tokenizer(folder, ["<image>"])
    torch.manual_seed(0)
    vision = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                           num_attention_heads=2, image_size=32, patch_size=8)
    model = transformers.LlavaForConditionalGeneration(transformers.LlavaConfig(
        text_config=transformers.LlamaConfig(**TEXT), vision_config=vision,
        image_token_index=tokenizer.convert_tokens_to_ids("<image>")))
    model.save_pretrained(folder)
    images = transformers.CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    transformers.LlavaProcessor(image_processor=images, tokenizer=tokenizer, patch_size=8, chat_template=LLAVA_CHAT,
                                vision_feature_select_strategy="default",
                                num_additional_image_tokens=1).save_pretrained(folder)      # (CLIP's CLS)


def save_qwen2_audio(folder) -> None:
    """Whisper's encoder (16 mel bins, 32 frames) + a 2-layer Qwen2, with Qwen2AudioProcessor and its own chat
    template ("Audio 1: <|audio_bos|><|AUDIO|><|audio_eos|>")."""
    import transformers
    tokenizer = _tokenizer(folder, ["<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>"])
    torch.manual_seed(0)
    audio = dict(d_model=32, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=64, num_mel_bins=16,
                 max_source_positions=16)
    model = transformers.Qwen2AudioForConditionalGeneration(transformers.Qwen2AudioConfig(
        audio_config=audio, text_config=dict(model_type="qwen2", **TEXT),
        audio_token_index=tokenizer.convert_tokens_to_ids("<|AUDIO|>")))
    model.save_pretrained(folder)
    features = transformers.WhisperFeatureExtractor(feature_size=16, sampling_rate=AUDIO_RATE, hop_length=100,
                                                    chunk_length=1, n_fft=200)
    transformers.Qwen2AudioProcessor(feature_extractor=features, tokenizer=tokenizer).save_pretrained(folder)


def save_qwen2_vl(folder, kind: str = "qwen2_vl") -> None:
    """Qwen2-VL's vision tower (4x4 patches, 2x2 merged into one token) + a 2-layer Qwen2 with 3D rotary positions,
    and the files of its hub folder: preprocessor_config.json (the image processor, processor_class
    Qwen2VLProcessor), the tokenizer with Qwen2-VL's special tokens and its chat template. The image processor is
    saved from PIL's (Qwen2VLImageProcessorPil, numpy) as "Qwen2VLImageProcessor", which transformers loads as
    PIL's where torchvision is missing (as on these machines). An image is resized to 64 to 1024 pixels: the
    40x48 PNGs of write_png to 24x32 (48 patches, 12 tokens). `kind` "qwen2_5_vl": Qwen2.5-VL's (its gated MLP,
    windowed attention in all but the last block; Qwen2_5_VLProcessor over the same image processor)."""
    import transformers
    tokenizer = _tokenizer(folder, ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"])
    ids = dict(zip(("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"),
                   tokenizer.convert_tokens_to_ids(["<|image_pad|>", "<|video_pad|>", "<|vision_start|>",
                                                    "<|vision_end|>"])))
    torch.manual_seed(0)
    text = dict(**TEXT, rope_scaling={"type": "mrope", "mrope_section": [2, 2, 4]}, bos_token_id=None,
                eos_token_id=tokenizer.eos_token_id)
    common = dict(depth=2, num_heads=2, patch_size=QWEN2_VL_PATCH, spatial_merge_size=QWEN2_VL_MERGE,
                  temporal_patch_size=2, in_chans=3)
    if kind == "qwen2_vl":
        model = transformers.Qwen2VLForConditionalGeneration(transformers.Qwen2VLConfig(
            text_config=text, vision_config=dict(**common, embed_dim=32, hidden_size=TEXT["hidden_size"]), **ids))
    else:
        vision = dict(**common, hidden_size=32, intermediate_size=64, out_hidden_size=TEXT["hidden_size"],
                      window_size=16, fullatt_block_indexes=[1])
        model = transformers.Qwen2_5_VLForConditionalGeneration(transformers.Qwen2_5_VLConfig(
            text_config=text, vision_config=vision, **ids))
    model.save_pretrained(folder)
    images = transformers.Qwen2VLImageProcessorPil(patch_size=QWEN2_VL_PATCH, merge_size=QWEN2_VL_MERGE,
                                                    temporal_patch_size=2, min_pixels=8 * 8, max_pixels=32 * 32)
    # (the hub's preprocessor_config.json names the processor)
    images.processor_class = "Qwen2VLProcessor" if kind == "qwen2_vl" else "Qwen2_5_VLProcessor"
    images.save_pretrained(folder)
    tokenizer.chat_template = QWEN2_VL_CHAT
    tokenizer.save_pretrained(folder)


def write_png(path, seed: int, size=(40, 48)) -> None:
    """A PNG of noise, `size` (height, width) pixels."""
    from PIL import Image
    pixels = np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path, format="PNG")


def png_bytes(seed: int) -> bytes:
    out = io.BytesIO()
    write_png(out, seed)
    return out.getvalue()


def write_wav(path, seed: int, seconds: float = 0.5, rate: int = AUDIO_RATE, channels: int = 1) -> np.ndarray:
    """A 16-bit PCM WAV file of noise; the samples as float in [-1, 1), channels averaged."""
    n = int(seconds * rate)
    pcm = np.random.default_rng(seed).integers(-20000, 20000, (n, channels), dtype=np.int16)
    with wave.open(str(path), "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.tobytes())
    return (pcm.astype(np.float32) / 32768.0).mean(axis=1)
