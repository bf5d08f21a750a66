"""Images in chat requests to a vision-language model (LLaVA, Qwen2-VL, ...): read from the request (a data:
URL, Ollama's base64 strings, a file under --allowed-local-media-path; never the network), laid out by the
model's own processor into the prompt's tokens and pixel tensors, and encoded once, on the batcher's thread,
into what the language model reads at the image tokens (Media.encoded: their embeddings, and Qwen2-VL's 3D
rotary positions).

The prefix cache keys an image's tokens by the image's content (a digest of its bytes), never by the
placeholder token every image shares: two prompts that differ only in their image share no block past it.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import io
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from bunsan.serve.errors import ApiError, shown

MAX_PIXELS = 40_000_000          # an image's width x height, read from its header before it is decoded
DATA_URL = re.compile(r"data:(image/[\w.+-]+)?(;[\w-]+=[\w.-]+)*;base64,(.*)", re.DOTALL)


def holds_images(body) -> bool:
    """Whether a request's body carries images (chat parts that are not text, Ollama's `images`)."""
    if not isinstance(body, dict):
        return False
    messages = body.get("messages")
    messages = messages if isinstance(messages, list) else []
    return bool(body.get("images")) or any(
        isinstance(m, dict) and (m.get("images") or isinstance(m.get("content"), list) and any(
            isinstance(p, dict) and p.get("type") != "text" for p in m["content"])) for m in messages)


async def parsed(parse, body, service):
    """`parse(body)`, on a worker thread when a vision model's request carries images (decoding them and the
    processor's work would hold up every other stream on the event loop), else here."""
    if service.vision is not None and holds_images(body):
        return await asyncio.to_thread(parse, body)
    return parse(body)


@dataclass
class Image:
    """One decoded image (RGB) and its content's digest."""
    pixels: object               # a PIL image
    digest: str


def _decoded(data: bytes, where: str) -> Image:
    from PIL import Image as PIL
    from PIL import UnidentifiedImageError
    try:
        image = PIL.open(io.BytesIO(data))
        if image.width * image.height > MAX_PIXELS:
            raise ApiError(400, f"{where} is {image.width}x{image.height} pixels; at most {MAX_PIXELS} are read "
                                "(shrink the image)", param=where)
        image = image.convert("RGB")      # (decodes it: a truncated file fails here)
    except (UnidentifiedImageError, OSError, ValueError, PIL.DecompressionBombError) as e:
        raise ApiError(400, f"{where} is not an image PIL can read ({type(e).__name__}: {str(e)[:120]}); send "
                            "a PNG, JPEG, GIF, WebP or BMP", param=where) from None
    return Image(image, hashlib.sha256(data).hexdigest())


class ImageReader:
    """Reads the images a request names: `url(text)` takes OpenAI's image_url (a data: URL, or a local file
    as file:///path or /path, only under `local_root`), `base64(text)` takes Ollama's images."""

    def __init__(self, local_root: str | Path | None = None):
        self.local_root = Path(local_root).resolve() if local_root else None

    def base64(self, text, where: str) -> Image:
        if not isinstance(text, str) or not text:
            raise ApiError(400, f"{where} is {shown(text)}; an image is a base64 string", param=where)
        try:
            data = base64.b64decode(text, validate=True)
        except (binascii.Error, ValueError):
            raise ApiError(400, f"{where} is not valid base64 (got {shown(text)}); send the image's bytes "
                                "base64-encoded", param=where) from None
        return _decoded(data, where)

    def url(self, url, where: str) -> Image:
        if not isinstance(url, str) or not url:
            raise ApiError(400, f"{where} is {shown(url)}; an image URL is a string", param=where)
        inline = DATA_URL.fullmatch(url)
        if inline:
            return self.base64(inline.group(3), where)
        if url.startswith("data:"):
            raise ApiError(400, f"{where} is a data: URL that is not base64 image data (got {shown(url)}); send "
                                "data:image/png;base64,...", param=where)
        if re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*://", url) and not url.startswith("file://"):
            raise ApiError(400, f"{where} is {shown(url)}: this server reads no network URLs; send the image "
                                "inline as a data: URL (data:image/png;base64,...)", param=where)
        return self._file(url.removeprefix("file://"), where)

    def _file(self, path: str, where: str) -> Image:
        if self.local_root is None:
            raise ApiError(400, f"{where} names the file {shown(path)}; this server reads no local files unless "
                                "started with --allowed-local-media-path DIR: send a data: URL", param=where)
        target = Path(path).resolve()
        if not target.is_relative_to(self.local_root):
            raise ApiError(400, f"{where} names {shown(path)}, outside --allowed-local-media-path "
                                f"{shown(str(self.local_root))}; only files under it are read", param=where)
        try:
            data = target.read_bytes()
        except OSError as e:
            raise ApiError(400, f"{where}: cannot read {shown(path)} ({type(e).__name__})", param=where) from None
        return _decoded(data, where)


@dataclass
class Encoded:
    """What the language model reads of a prompt's images: `embeddings` [rows, hidden] at the prompt positions
    `rows`; `positions` [3, prompt] the 3D rotary positions of a model that has them (None: plain positions),
    the tokens after the prompt at their position + `delta`."""
    rows: torch.Tensor
    embeddings: torch.Tensor
    positions: torch.Tensor | None
    delta: int


@dataclass
class Media:
    """A prompt's images as the processor laid them out: `inputs` (pixel_values, image_grid_thw, ...) until
    encoded, `keys` the prompt's tokens for the prefix cache (each image token keyed by its image's digest)."""
    inputs: dict
    keys: list
    encoded: Encoded | None = None
    failed: str | None = field(default=None)

    @property
    def length(self) -> int:
        return len(self.keys)

    def at(self, start: int, count: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """For the tokens start..start+count of the sequence: (their indices among them that read an image
        embedding, those embeddings, the tokens' 3D positions [3, count] or None)."""
        e = self.encoded
        inside = (e.rows >= start) & (e.rows < start + count)
        positions = None
        if e.positions is not None:
            at = torch.arange(start, start + count)
            positions = (at + e.delta).expand(3, count).clone()
            prompt = at < self.length
            positions[:, prompt] = e.positions[:, at[prompt]]
        return e.rows[inside] - start, e.embeddings[inside], positions


def image_keys(ids: list[int], image_token: int, images: list[Image]) -> list:
    """The prompt's prefix-cache keys: its token ids, each image token replaced by (its image's digest, its
    index in the image). The images' runs of tokens are matched to them in order; where the runs do not
    part one image from the next (adjacent images), every image token is keyed by all the images' digests."""
    keys: list = list(ids)
    at = [i for i, t in enumerate(ids) if t == image_token]
    runs = [[p] for p in at[:1]]
    for prev, p in zip(at, at[1:]):
        runs[-1].append(p) if p == prev + 1 else runs.append([p])
    if len(runs) == len(images):
        for run, image in zip(runs, images):
            for j, p in enumerate(run):
                keys[p] = (image.digest, j)
    else:
        everything = hashlib.sha256("".join(i.digest for i in images).encode()).hexdigest()
        for j, p in enumerate(at):
            keys[p] = (everything, j)
    return keys


class VisionInputs:
    """The served vision-language model's processor: `layout(text, images)` -> (the prompt's ids, its Media)."""

    def __init__(self, folder: str | Path, reader: ImageReader, image_token_id: int):
        from bunsan.models.processor import load_processor
        self.processor = load_processor(folder)         # (Qwen2-VL's without torchvision too: no video)
        if getattr(self.processor, "image_processor", None) is None:
            raise ValueError(f"{folder}'s processor ({type(self.processor).__name__}) has no image processor")
        self.reader, self.image_token_id = reader, image_token_id
        self.placeholder = getattr(self.processor, "image_token", None)

    def layout(self, text: str, images: list[Image]) -> tuple[list[int], Media]:
        out = self.processor(text=[text], images=[i.pixels for i in images], return_tensors="pt",
                             add_special_tokens=False)
        ids = out.pop("input_ids")[0].tolist()
        out.pop("attention_mask", None)
        if not any(t == self.image_token_id for t in ids):
            raise ApiError(400, "the chat template put no image in the prompt; this model's template takes "
                                "image content parts in user messages", param="messages")
        return ids, Media(dict(out), image_keys(ids, self.image_token_id, images))


def overlay(spans: list, at: torch.Tensor):
    """A forward's image inputs (TransformersLM.forward's `view.media`): `spans` is each row's (Media or None,
    first position, tokens) in the forward's order, `at` every token's position. (the token indices that read
    an image embedding, those embeddings, every token's 3D positions [3, tokens] or None), or None when no
    token needs either."""
    index, embeddings, positions, offset = [], [], None, 0
    for media, start, count in spans:
        if media is not None:
            i, e, p = media.at(start, count)
            index.append(i + offset)
            embeddings.append(e)
            if p is not None:
                if positions is None:
                    positions = at.expand(3, -1).clone()
                positions[:, offset:offset + count] = p
        offset += count
    index = torch.cat(index) if index else torch.zeros(0, dtype=torch.long)
    if not index.numel() and positions is None:
        return None
    return index, torch.cat(embeddings) if embeddings else None, positions
