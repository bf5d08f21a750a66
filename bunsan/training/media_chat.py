"""Chat records with images and audio, rendered by the model's own processor (AutoProcessor of its directory:
its chat template, image processor, feature extractor; models/processor.py), masked as text chat is
(chat_masks.py).

The template's text is masked by character spans as text chat's, tokenized by the processor's tokenizer; the
processor then writes each placeholder out as the image's or clip's tokens. Matching the two token sequences
says which expanded token is which: a token both have keeps its mask, one the processor added (an image's
tokens) is never trained, and a trained token the processor changed is an error, never a guess. Placeholder
tokens are never trained, wherever they stand.

Rows keep where their media is, not the pixels (a data set's images would not fit in memory): each batch runs
the processor again on its rows (media_batches.py) and checks it gives the same token ids.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from pathlib import Path

from bunsan.training.chat_masks import assistant_spans, template_text, trained_by_offsets
from bunsan.training.chat_records import BadRecord
from bunsan.training.media_records import Source, load_audio, load_image, take_sources

__all__ = ["MediaChat", "MediaSpec", "PER_TOKEN"]

PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")
# processor outputs with one entry per token (the rest hold one entry per image or clip, or flat patches)
PER_TOKEN = ("mm_token_type_ids", "token_type_ids")
# what the rows hold already (input_ids), or need not carry: rows are right-padded and attention is causal
TEXT_KEYS = ("input_ids", "attention_mask")


@dataclass(frozen=True)
class MediaSpec:
    """A rendered record's media, to be processed again when its row is batched."""
    where: str
    text: str                     # the template's rendering, placeholders unexpanded
    sources: tuple[Source, ...]   # images and clips in order
    tokens: int                   # the processor's token count for it


class MediaChat:
    """A processor that reads images and/or audio, and how its records are rendered and masked."""

    def __init__(self, processor, folder, train_on_prompt: bool, row_tokens: int | None = None):
        self.processor, self.folder, self.train_on_prompt, self.row_tokens = processor, folder, train_on_prompt, \
            row_tokens
        self.images = getattr(processor, "image_processor", None)
        self.audio = getattr(processor, "feature_extractor", None) or getattr(processor, "audio_processor", None)
        tok = processor.tokenizer
        self.placeholders = {}           # kind -> (placeholder text, its token id)
        for kind in ("image", "audio", "video"):
            text = getattr(processor, f"{kind}_token", None)
            if isinstance(text, str) and tok.convert_tokens_to_ids(text) is not None:
                self.placeholders[kind] = (text, tok.convert_tokens_to_ids(text))
        self.placeholder_ids = {i for _, i in self.placeholders.values()}
        # Qwen2-VL's processors lay patches flat with a grid per image, which the engine cuts by row whatever
        # the images per row (engine/media.py); any other image or clip tensor has one entry per item, and a
        # batch cut by rows needs one per row
        self.grouped = self.images is not None and "image_grid_thw" in getattr(processor, "model_input_names", ())

    @classmethod
    def from_folder(cls, folder, train_on_prompt: bool, row_tokens: int | None = None) -> MediaChat | None:
        """The folder's processor when it reads images or audio; None for a tokenizer alone."""
        if not any((Path(folder) / f).is_file() for f in PROCESSOR_FILES):
            return None
        from bunsan.models.processor import load_processor
        try:
            processor = load_processor(folder)
        except Exception as e:      # noqa: BLE001  (a missing backend's ImportError, a config's ValueError, ...)
            raise ValueError(f"{folder} has a processor ({' or '.join(PROCESSOR_FILES)}) that transformers cannot "
                             f"load ({type(e).__name__}: {str(e).strip()[:300]}); chat records with images or "
                             "audio are rendered through it") from None
        chat = cls(processor, folder, train_on_prompt, row_tokens)
        return chat if chat.images is not None or chat.audio is not None else None

    def _reads(self, s: Source, where: str) -> None:
        reader = self.images if s.kind == "image" else self.audio
        if reader is None:
            has = "images" if self.images is not None else "audio"
            raise BadRecord(f"{where}: {s.at} is {s.kind}, and {self.folder}'s processor "
                            f"({type(self.processor).__name__}) reads {has} only; drop the part or train a model "
                            f"that takes {s.kind}")
        if s.kind not in self.placeholders:
            raise BadRecord(f"{where}: {s.at}: {type(self.processor).__name__} names no {s.kind} token, so its "
                            f"{s.kind} tokens cannot be kept out of the loss")

    def _loaded(self, sources, where: str) -> dict:
        """The processor's media arguments: images=[...], audio=[...]."""
        images = [load_image(s, where) for s in sources if s.kind == "image"]
        rate = getattr(self.audio, "sampling_rate", None)
        most = getattr(self.audio, "n_samples", None)
        audio = [load_audio(s, where, rate, most) for s in sources if s.kind == "audio"]
        return {**({"images": images} if images else {}), **({"audio": audio, "sampling_rate": rate} if audio else {})}

    def process(self, text: str, sources, where: str) -> dict:
        """The processor's batch of one: input_ids [1, n] and its media tensors."""
        try:
            return dict(self.processor(text=[text], **self._loaded(sources, where), return_tensors="pt",
                                       add_special_tokens=False, return_mm_token_type_ids=True))
        except BadRecord:
            raise
        except Exception as e:      # noqa: BLE001  (the processor's own checks: token and image counts, sizes)
            raise BadRecord(f"{where}: {type(self.processor).__name__} cannot process this record "
                            f"({type(e).__name__}: {str(e).strip()[:300]})") from None

    def render(self, messages: list[dict], tools, where: str):
        """(token ids, trained per token, MediaSpec) of a checked conversation."""
        messages, sources, video = take_sources(messages, getattr(where, "folder", None), where)
        if video:
            raise BadRecord(f"{where}: {video} is a video, which bunsan train does not read yet; drop the part")
        for s in sources:
            self._reads(s, where)
        for kind, (text, _) in self.placeholders.items():
            n = sum(s.kind == kind for s in sources)
            if n > 1 and (kind == "audio" or not self.grouped):
                raise BadRecord(f"{where}: {n} {kind}s in one record; {type(self.processor).__name__} gives one "
                                f"tensor entry per {kind} and a batch is cut by rows, so each record holds at most "
                                f"one {kind} (a processor with grids, Qwen2-VL's, takes any number of images)")
        render = template_text(self.processor.apply_chat_template, tools, where, "the processor's")
        full, spans = assistant_spans(render, messages, where)
        for kind, (text, _) in self.placeholders.items():
            n = sum(s.kind == kind for s in sources)
            if full.count(text) != n:
                raise BadRecord(f"{where}: the processor's chat template writes {full.count(text)} {text} "
                                f"placeholder(s) for the record's {n} {kind}(s); each {kind} part needs one")
        plain = self.processor.tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
        marks = trained_by_offsets(plain["offset_mapping"], spans, self.train_on_prompt)
        out = self.process(full, sources, where)
        ids = out["input_ids"][0].tolist()
        trained = self._aligned(list(plain["input_ids"]), marks, ids, where)
        if not any(trained):
            raise BadRecord(f"{where}: no assistant turn to train on (roles {[m['role'] for m in messages]}); "
                            "give each conversation an assistant message")
        media_at = [i for i, t in enumerate(ids) if t in self.placeholder_ids]
        if self.row_tokens is not None and media_at and media_at[-1] >= self.row_tokens:
            raise BadRecord(f"{where}: {len(ids)} tokens with its media's, and data.seq_len + 1 = {self.row_tokens} "
                            f"would cut the media's tokens (the last at {media_at[-1]}) from their features; raise "
                            "data.seq_len or shorten the record")
        return ids, trained, MediaSpec(where, full, tuple(sources), len(ids))

    def _aligned(self, plain: list[int], marks: list[bool], ids: list[int], where: str) -> list[bool]:
        """The masks of `plain` (the template's tokens) carried onto `ids` (the processor's, placeholders written
        out): a token both have keeps its mask, one the processor added is not trained."""
        trained = _walked(plain, marks, ids, self.placeholder_ids)
        if trained is None:           # the processor also retokenized around its insertions (Gemma 3's "\n\n")
            trained = [False] * len(ids)
            matcher = difflib.SequenceMatcher(None, plain, ids, autojunk=False)
            for op, a0, a1, b0, b1 in matcher.get_opcodes():
                if op == "equal":
                    trained[b0:b1] = marks[a0:a1]
                elif op in ("replace", "delete") and any(marks[a0:a1]):
                    raise BadRecord(f"{where}: the processor changed trained tokens ({plain[a0:a1][:8]} became "
                                    f"{ids[b0:b1][:8]}) while writing out its placeholders, so the loss mask "
                                    "cannot be carried over; keep media parts out of the assistant's turns")
        return [t and i not in self.placeholder_ids for t, i in zip(trained, ids)]

    def tensors(self, spec: MediaSpec, row_ids) -> dict:
        """A row's media tensors, the processor run again; its ids must be the row's (a file changed on disk
        since the records were rendered would give others)."""
        out = self.process(spec.text, spec.sources, spec.where)
        ids = out["input_ids"][0]
        n = min(len(ids), len(row_ids))
        if len(ids) != spec.tokens or not bool((ids[:n] == row_ids[:n]).all()):
            raise ValueError(f"{spec.where}: the processor gives other tokens for this record than when the data "
                             "was read (an image or audio file changed on disk during the run?); restart the run")
        return {k: v for k, v in out.items() if k not in TEXT_KEYS}


def _walked(plain: list[int], marks: list[bool], ids: list[int], placeholders: set[int]) -> list[bool] | None:
    """The masks carried over in one pass when the processor only added tokens, and only placeholders or where
    the template's tokens are not trained (a trained token is matched in place or the pass gives up: None); None
    too when some template token is not found. (A full diff is quadratic: seconds for a row of 8k tokens.)"""
    trained, i = [False] * len(ids), 0
    for j, t in enumerate(ids):
        if i < len(plain) and t == plain[i]:
            trained[j], i = marks[i], i + 1
        elif i < len(plain) and marks[i] and t not in placeholders:
            return None
    return trained if i == len(plain) else None


def check_media_rows(rows) -> None:
    """A processor that gives one tensor entry per image or clip (not flat patches with grids) gets batches whose
    rows all have one, or none: mixed, a batch's entries would not be one per row, which the engine cannot cut."""
    chat = rows.media_chat
    for kind in ("image", "audio"):
        if kind == "image" and chat.grouped:
            continue
        have = [any(s.kind == kind for s in spec.sources) for spec in rows.media]
        if any(have) and not all(have):
            with_, without = rows.media[have.index(True)].where, rows.media[have.index(False)].where
            raise ValueError(f"some records have an {kind} ({with_}) and some none ({without}): "
                             f"{type(chat.processor).__name__} gives one tensor entry per {kind}, and a batch is cut "
                             f"by rows, so every record needs exactly one {kind} or none; train them in separate "
                             "runs")
