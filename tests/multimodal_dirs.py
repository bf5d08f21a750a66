"""Tiny vision- and audio-language model directories as Hugging Face saves them, built here without downloads:
a byte-level tokenizer with the model's special tokens, its image processor or feature extractor, a chat
template, the processor (save_pretrained) and random weights. What `bunsan train --init-from` and the
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


def write_png(path, seed: int, size=(40, 48)) -> None:
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
