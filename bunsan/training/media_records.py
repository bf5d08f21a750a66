"""Multimodal chat records as people keep them, to the conversation a processor's chat template renders and the
images and audio its processor reads.

    {"messages": [{"role": "user", "content": [{"type": "image", "image": "cat.jpg"},          HF / OpenAI parts
                                               {"type": "text", "text": "What is this?"}]},
                  {"role": "assistant", "content": "A cat."}]}
        image parts: {"type": "image", "image": P}, {"type": "image_url", "image_url": {"url": P}}, "input_image"
        audio parts: {"type": "audio", "audio": P}, {"type": "audio_url", "audio_url": {"url": P}},
                     {"type": "input_audio", "input_audio": {"data": BASE64, "format": "wav"}}
    {"image": "cat.jpg", "conversations": [{"from": "human", "value": "<image>\\nWhat is this?"},        LLaVA's
                                           {"from": "gpt", "value": "A cat."}]}                        (ShareGPT)
    {"messages": [... "<image>" in the text ...], "images": ["cat.jpg"]}                  LLaMA-Factory's

P is a file path (relative to the data file's folder), a file:// or data: URL, or what a `datasets` row holds
(an image's {"bytes", "path"}, an audio's {"array", "sampling_rate"}, a PIL image). bunsan reads no network:
an http(s) URL is an error, as is a file that is missing or unreadable, each naming the record and the part.
"""

from __future__ import annotations

import base64
import binascii
import io
import wave
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

import numpy as np

from bunsan.training.chat_records import BadRecord

__all__ = ["Source", "conversation", "refuse_media", "take_sources", "load_image", "load_audio"]

KINDS = {"image": "image", "image_url": "image", "input_image": "image", "audio": "audio", "audio_url": "audio",
         "input_audio": "audio", "video": "video", "video_url": "video"}
MARKERS = {"image": "<image>", "audio": "<audio>"}
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system",
                  "observation": "tool", "tool": "tool", "function_call": "assistant"}


@dataclass(frozen=True)
class Source:
    """One image or audio clip of a record: where it is said (`at`), and a file, bytes or a decoded value."""
    kind: str                 # "image" or "audio"
    at: str                   # "message 0 part 1 (image_url)"
    path: Path | None = None
    data: bytes | None = None
    value: Any = None         # a datasets row's decoded image or audio


def conversation(rec: dict, key: str, where: str) -> list | None:
    """The record's messages (`key`, or ShareGPT's `conversations`) with a top-level `images`/`audios` list placed
    at their <image>/<audio> markers; None when the record has neither (the caller names the missing field)."""
    if key in rec and rec[key] is not None:
        messages = rec[key]
    elif isinstance(rec.get("conversations"), list):
        messages = [_sharegpt(m, k, where) for k, m in enumerate(rec["conversations"])]
    else:
        return None
    for kind, names in (("image", ("images", "image")), ("audio", ("audios", "audio"))):
        name = next((n for n in names if rec.get(n) is not None), None)
        if name is not None and isinstance(messages, list):
            files = rec[name] if isinstance(rec[name], list) else [rec[name]]
            messages = _placed(messages, kind, files, name, where)
    return messages


def _sharegpt(m, k: int, where: str) -> dict:
    if not isinstance(m, dict) or "from" not in m:
        raise BadRecord(f"{where}: conversations[{k}] is not a ShareGPT turn {{from, value}}")
    role = SHAREGPT_ROLES.get(m["from"])
    if role is None:
        raise BadRecord(f"{where}: conversations[{k}] is from {m['from']!r}, not one of {sorted(SHAREGPT_ROLES)}")
    return {"role": role, "content": m.get("value")}


def _placed(messages: list, kind: str, files: list, name: str, where: str) -> list:
    """The messages with each `marker` in their text replaced by the next of `files` as a part (none marked:
    all before the first user turn's text, as LLaVA's data has them)."""
    marker = MARKERS[kind]
    texts = [m.get("content") for m in messages if isinstance(m, dict)]
    count = sum(t.count(marker) for t in texts if isinstance(t, str))
    if count and count != len(files):
        raise BadRecord(f"{where}: {count} {marker} marker(s) in the text but {len(files)} file(s) in {name!r}; "
                        "each marker takes one, in order")
    todo, out = list(files), []
    for m in messages:
        first = not count and todo and isinstance(m, dict) and m.get("role") == "user"
        if first and isinstance(m.get("content"), list):
            out.append({**m, "content": [{"type": kind, kind: f} for f in todo] + m["content"]})
            todo = []
            continue
        if not isinstance(m, dict) or not isinstance(m.get("content"), str):
            out.append(m)
            continue
        text, parts = m["content"], []
        if first:
            parts, todo = [{"type": kind, kind: f} for f in todo], []
        pieces = text.split(marker) if count else [text]
        for i, piece in enumerate(pieces):
            if i:
                parts.append({"type": kind, kind: todo.pop(0)})
            if piece:
                parts.append({"type": "text", "text": piece})
        out.append({**m, "content": parts} if parts != [{"type": "text", "text": text}] else m)
    if todo:
        raise BadRecord(f"{where}: {name!r} has {len(files)} file(s) and no user turn to place them in")
    return out


def media_parts(messages: list[dict]):
    """(message index, part index, part, kind) of every image, audio or video part."""
    for k, m in enumerate(messages):
        content = m.get("content")
        if isinstance(content, list):
            for j, part in enumerate(content):
                kind = KINDS.get(part.get("type")) or next((KINDS[t] for t in ("image", "audio", "video")
                                                            if t in part and part.get("type") is None), None)
                if kind is not None:
                    yield k, j, part, kind


def refuse_media(messages: list[dict], where: str, fmt: str) -> None:
    """Text chat: an image or audio part is an error (it would be dropped by the template, or rendered as text)."""
    for k, j, part, kind in media_parts(messages):
        why = (f"data.format {fmt} takes no images or audio (chat records alone go through the model's processor)"
               if fmt != "chat" else "the tokenizer's folder has no processor that reads images or audio (a "
               "text-only model); set train.init_from to a vision- or audio-language model's directory (with its "
               "processor_config.json or preprocessor_config.json)")
        raise BadRecord(f"{where}: message {k} part {j} is {kind} ({part.get('type')}), and {why}")


def _url(part: dict, kind: str):
    """The value a part names its media by."""
    t = part.get("type") or kind
    if t == "input_audio" and isinstance(part.get(t), dict):
        value = part[t]
        return f"data:audio/{value.get('format', 'wav')};base64,{value.get('data', '')}"
    value = part[t] if t in part else part.get("image_url") if t == "input_image" else part.get(kind)
    if isinstance(value, dict) and "url" in value:
        return value["url"]
    return value if value is not None else part.get("url", part.get("path"))


def take_sources(messages: list[dict], folder, where: str) -> tuple[list[dict], list[Source], str | None]:
    """(the messages with each media part as the template takes it, {"type": kind}; the media in order; the
    first part a template reads that bunsan cannot train: a video, else None)."""
    sources, out, video = [], [], None
    found = {(k, j): (part, kind) for k, j, part, kind in media_parts(messages)}
    for k, m in enumerate(messages):
        if not any(key[0] == k for key in found):
            out.append(m)
            continue
        content = []
        for j, part in enumerate(m["content"]):
            if (k, j) not in found:
                content.append(part)
                continue
            kind = found[k, j][1]
            at = f"message {k} part {j} ({part.get('type') or kind})"
            if kind == "video":
                video = video or at
                continue
            sources.append(_source(kind, at, _url(part, kind), folder, where))
            content.append({"type": kind})
        out.append({**m, "content": content})
    return out, sources, video


def _source(kind: str, at: str, value, folder, where: str) -> Source:
    if isinstance(value, dict) and value.get("bytes") is not None:      # a datasets Image column's row
        return Source(kind, at, data=bytes(value["bytes"]))
    if isinstance(value, dict) and "array" in value:                     # a datasets Audio column's row
        return Source(kind, at, value=value)
    if isinstance(value, dict) and value.get("path"):
        value = value["path"]
    if not isinstance(value, str):
        if type(value).__module__.startswith("PIL."):
            return Source(kind, at, value=value)
        raise BadRecord(f"{where}: {at} names its {kind} by a {type(value).__name__} ({str(value)[:40]!r}); give a file "
                        "path, a file:// or data: URL")
    if value.startswith(("http://", "https://")):
        raise BadRecord(f"{where}: {at}: {value[:80]!r} is a network URL, and bunsan reads no network while training; "
                        "download the file and name its path (relative to the data file's folder)")
    if value.startswith("data:"):
        head, _, payload = value.partition(",")
        if not head.endswith(";base64"):
            raise BadRecord(f"{where}: {at}: a data: URL ({head[:40]!r}) that is not base64; write data:<type>;base64,...")
        try:
            return Source(kind, at, data=base64.b64decode(payload, validate=True))
        except (binascii.Error, ValueError):
            raise BadRecord(f"{where}: {at}: the data: URL's payload is not valid base64") from None
    path = Path(unquote(urlparse(value).path)) if value.startswith("file://") else Path(value).expanduser()
    if not path.is_absolute():
        path = Path(folder or ".") / path
    if not path.is_file():
        raise BadRecord(f"{where}: {at}: {kind} file {value!r} not found (looked at {path}); relative paths are read from "
                        "the data file's folder")
    return Source(kind, at, path=path.resolve())


def load_image(s: Source, where: str):
    """The image, decoded whole (a truncated file fails here, naming it, not inside the processor)."""
    from PIL import Image, UnidentifiedImageError
    if s.value is not None:
        return s.value
    try:
        image = Image.open(s.path if s.path is not None else io.BytesIO(s.data))
        image.load()
    except (UnidentifiedImageError, OSError, ValueError) as e:
        raise BadRecord(f"{where}: {s.at}: {s.path or 'the inline data'} is not an image PIL can read "
                        f"({type(e).__name__}: {str(e)[:120]})") from None
    return image


def load_audio(s: Source, where: str, rate: int, max_samples: int | None) -> np.ndarray:
    """The clip as float32 samples in [-1, 1] at the feature extractor's `rate` (channels averaged to mono, as
    the model hears one): a WAV file (PCM) or a datasets row; another rate or a clip longer than the extractor
    reads is an error (it would be resampled wrong or cut silently)."""
    name = s.path or "the inline data"
    if s.value is not None:
        samples, got = np.asarray(s.value["array"], dtype=np.float32), s.value.get("sampling_rate")
    else:
        try:
            with wave.open(str(s.path) if s.path is not None else io.BytesIO(s.data)) as w:
                width, channels, got = w.getsampwidth(), w.getnchannels(), w.getframerate()
                raw = w.readframes(w.getnframes())
        except (wave.Error, EOFError, OSError) as e:
            raise BadRecord(f"{where}: {s.at}: {name} is not a PCM WAV file ({type(e).__name__}: {e}); convert it "
                            f"(ffmpeg -i IN -ac 1 -ar {rate} -c:a pcm_s16le OUT.wav)") from None
        if width not in (1, 2, 4):
            raise BadRecord(f"{where}: {s.at}: {name} has {8 * width}-bit samples; write 8-, 16- or 32-bit PCM")
        dtype = {1: np.uint8, 2: np.int16, 4: np.int32}[width]
        samples = np.frombuffer(raw, dtype=dtype).astype(np.float32)
        samples = (samples - 128.0) / 128.0 if width == 1 else samples / float(np.iinfo(dtype).max + 1)
        samples = samples.reshape(-1, channels).mean(axis=1)
    if got != rate:
        raise BadRecord(f"{where}: {s.at}: {name} is sampled at {got} Hz and the model's feature extractor reads "
                        f"{rate} Hz; resample it (ffmpeg -i IN -ar {rate} OUT.wav)")
    if max_samples is not None and len(samples) > max_samples:
        raise BadRecord(f"{where}: {s.at}: {name} is {len(samples) / rate:.2f} s, and the model's feature extractor "
                        f"reads at most {max_samples / rate:.2f} s (the rest would be cut silently); split the clip")
    return samples
