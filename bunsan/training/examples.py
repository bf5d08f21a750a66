"""Fine-tuning data as people have it: records (JSONL, JSON, Parquet, a `datasets` dataset saved to disk) in one
of four formats, rendered to token ids and the labels the loss is taken on.

    text               {"text": ...}                                        every token trained
    prompt_completion  {"prompt": ..., "completion": ...}                   the completion (and EOS) trained
    instruction        {"instruction": ..., "input": ..., "output": ...}    Alpaca's fields; the output trained
    chat               {"messages": [{"role": ..., "content": ...}, ...]}   the assistant turns trained
    preference         {"prompt" or "messages", "chosen", "rejected"}       each response scored (DPO:
                       a prompt as text or messages, a response as text or assistant messages; preference_data.py)
                       (every field of a message reaches the template: tool_calls, tool_call_id, name, ...;
                       a record's "tools" too: chat_records.py)
                       (ShareGPT's {"conversations": [{"from", "value"}]} too; with the model's processor,
                       images and audio in the messages: media_records.py, media_chat.py)

Field names are configurable (data.fields). Chat, and instruction when the tokenizer has one, use the
tokenizer's own chat template (its tokenizer_config.json, rendered by transformers); an assistant turn is
what the template adds between the conversation rendered up to that turn with the generation prompt and
rendered through it, so its end-of-turn token is trained exactly as the template writes it. Without a
template, instruction examples use Alpaca's prompt. `train_on_prompt` trains every token instead.

A record that cannot be rendered or masked is an error naming its file:line and why (BadRecord), or with
`on_bad_record="skip"` left out and counted.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

from bunsan.models.hf import has_chat_template
from bunsan.training.chat_masks import assistant_spans, template_text, trained_by_offsets
from bunsan.training.chat_records import BadRecord, Where, checked_messages, checked_tools, text_field
from bunsan.training.media_records import conversation, refuse_media

__all__ = ["FORMATS", "DEFAULT_FIELDS", "is_dataset_dir", "read_records", "Renderer"]

FORMATS = ("text", "prompt_completion", "instruction", "chat", "preference")
DEFAULT_FIELDS = {"text": "text", "prompt": "prompt", "completion": "completion", "instruction": "instruction",
                  "input": "input", "output": "output", "messages": "messages", "role": "role",
                  "content": "content", "chosen": "chosen", "rejected": "rejected"}
RECORD_FILES = (".jsonl", ".json", ".parquet")
ALPACA = ("Below is an instruction that describes a task{with_input}. Write a response that appropriately "
          "completes the request.\n\n### Instruction:\n{instruction}\n\n{input_block}### Response:\n")


def is_dataset_dir(path: Path) -> bool:
    """A `datasets` dataset saved with save_to_disk."""
    return path.is_dir() and ((path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file())


def is_record_file(path: Path) -> bool:
    return path.suffix.lower() in RECORD_FILES


def read_records(paths: list[Path], on_bad_record: str = "error") -> Iterator[tuple[str, dict | BadRecord]]:
    """(where, record) of every record, in order: JSONL lines, a JSON list, Parquet rows, a dataset's rows. With
    on_bad_record "skip", a JSONL line that is no record comes as (where, the BadRecord) for the renderer to count."""
    for path in paths:
        if is_dataset_dir(path):
            yield from _dataset_rows(path)
        elif path.suffix.lower() == ".jsonl":
            with open(path, "rb") as f:
                for n, raw in enumerate(f, 1):
                    try:
                        line = _utf8(raw, f"{path}:{n}")
                        rec = _object(line, f"{path}:{n}") if line.strip() else None
                    except BadRecord as e:
                        if on_bad_record != "skip":
                            raise
                        rec = e
                    if rec is not None:
                        yield Where(f"{path}:{n}", path.parent), rec
        elif path.suffix.lower() == ".json":
            try:
                data = json.loads(_utf8(path.read_bytes(), str(path)))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: not JSON ({e.msg} at line {e.lineno} column {e.colno}); fix the file, "
                                 "or write one record per line as .jsonl") from None
            if not isinstance(data, list):
                raise ValueError(f"{path}: a JSON data file holds a list of records, got {type(data).__name__}")
            for n, rec in enumerate(data):
                yield Where(f"{path}[{n}]", path.parent), _checked(rec, f"{path}[{n}]")
        elif path.suffix.lower() == ".parquet":
            yield from _parquet_rows(path)
        else:
            raise ValueError(f"data file {path} is not .jsonl, .json or .parquet (nor a saved datasets directory); "
                             "a data.format other than text reads records")


def _utf8(raw: bytes, where: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadRecord(f"{where}: not UTF-8 (byte 0x{raw[e.start]:02x} at offset {e.start}: {e.reason}); "
                         "re-encode the file as UTF-8 (iconv -f latin1 -t utf-8)") from None


def _parquet_rows(path: Path) -> Iterator[tuple[str, dict]]:
    import pyarrow as pa
    import pyarrow.parquet as pq
    try:
        rows = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise ValueError(f"{path}: not a readable Parquet file ({type(e).__name__}: {str(e)[:200]})") from None
    n = 0
    for batch in rows.iter_batches(batch_size=1024):
        for rec in batch.to_pylist():
            yield Where(f"{path} row {n}", path.parent), rec
            n += 1


def _object(line: str, where: str) -> dict:
    try:
        return _checked(json.loads(line), where)
    except json.JSONDecodeError as e:
        raise BadRecord(f"{where}: not a JSON object ({e.msg} at column {e.colno}); fix the line") from None


def _checked(rec, where: str) -> dict:
    if not isinstance(rec, dict):
        raise BadRecord(f"{where}: a record must be a JSON object, got {type(rec).__name__}")
    return rec


def _dataset_rows(path: Path) -> Iterator[tuple[str, dict]]:
    import datasets
    data = datasets.load_from_disk(str(path))
    if isinstance(data, datasets.DatasetDict):
        if "train" not in data:
            raise ValueError(f"{path} is a DatasetDict without a 'train' split (it has {sorted(data)}); save the "
                             "split to train on")
        data = data["train"]
    for n, rec in enumerate(data):
        yield Where(f"{path} row {n}", path.parent), rec


class Renderer:
    """Records to (ids, trained) pairs: token ids and, per token, whether the loss is taken on it."""

    def __init__(self, fmt: str, tokenizer, folder: Path | None, fields: dict, train_on_prompt: bool,
                 on_bad_record: str = "error", seq_len: int | None = None):
        if fmt not in FORMATS:
            raise ValueError(f"data.format {fmt!r} is not one of {', '.join(FORMATS)}")
        if on_bad_record not in ("error", "skip"):
            raise ValueError(f"data.on_bad_record {on_bad_record!r} is not 'error' or 'skip'")
        self.fmt, self.tokenizer, self.train_on_prompt = fmt, tokenizer, train_on_prompt
        self.on_bad_record = on_bad_record
        self.fields = {**DEFAULT_FIELDS, **fields}
        self.hf = None
        if folder is not None and has_chat_template(folder):
            from transformers import AutoTokenizer
            self.hf = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        if fmt == "chat" and self.hf is None:
            raise ValueError(f"data.format chat renders conversations with the tokenizer's chat template, and "
                             f"{folder or 'the byte tokenizer'} has none; set data.tokenizer to a Hugging Face "
                             "tokenizer directory with a chat_template (tokenizer_config.json)")
        self.eos = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
        # a folder whose processor reads images or audio renders chat records through it (media_chat.py)
        self.media = None
        if fmt == "chat" and folder is not None:
            from bunsan.training.media_chat import MediaChat
            self.media = MediaChat.from_folder(folder, train_on_prompt, None if seq_len is None else seq_len + 1)

    def _field(self, rec: dict, name: str, where: str, optional: bool = False, text: bool = True):
        key = self.fields[name]
        if key not in rec or rec[key] is None:
            if optional:
                return ""
            raise BadRecord(f"{where}: no field {key!r} (data.format {self.fmt} reads {name} from it; set "
                            f"data.fields.{name} to the field your records use); it has {sorted(rec)[:8]}")
        return text_field(rec[key], name, key, where) if text else rec[key]

    def render_or_skip(self, rec: dict, where: str):
        """render(); with on_bad_record "skip", (None, why) for a record it refuses."""
        try:
            if isinstance(rec, BadRecord):     # (read_records found the line was no record)
                raise rec
            return self.render(rec, where)
        except BadRecord as e:
            if self.on_bad_record == "skip":
                return None, str(e)
            raise

    def render(self, rec: dict, where: str) -> tuple[list[int], list[bool]]:
        if self.fmt == "preference":     # (a pair of them: chosen, rejected)
            from bunsan.training.preference_data import render_pair
            return render_pair(self, rec, where)
        if self.fmt == "text":
            ids = self.tokenizer.encode(self._field(rec, "text", where)) + self.eos
            return ids, [True] * len(ids)
        if self.fmt == "prompt_completion":
            prompt = self.tokenizer.encode(self._field(rec, "prompt", where))
            answer = self.tokenizer.encode(self._field(rec, "completion", where)) + self.eos
            return prompt + answer, [self.train_on_prompt] * len(prompt) + [True] * len(answer)
        if self.fmt == "instruction":
            instruction, extra = self._field(rec, "instruction", where), self._field(rec, "input", where, True)
            output = self._field(rec, "output", where)
            if self.hf is not None:
                user = instruction + (f"\n\n{extra}" if extra else "")
                return self._chat([{"role": "user", "content": user}, {"role": "assistant", "content": output}],
                                  where)
            prompt = ALPACA.format(with_input=", paired with an input that provides further context" if extra
                                   else "", instruction=instruction,
                                   input_block=f"### Input:\n{extra}\n\n" if extra else "")
            ids_p, ids_a = self.tokenizer.encode(prompt), self.tokenizer.encode(output) + self.eos
            return ids_p + ids_a, [self.train_on_prompt] * len(ids_p) + [True] * len(ids_a)
        raw = conversation(rec, self.fields["messages"], where)      # messages, or ShareGPT's conversations
        if raw is None:
            raw = self._field(rec, "messages", where, text=False)        # (an error naming the missing field)
        messages = checked_messages(raw, self.fields["messages"], self.fields["role"], self.fields["content"],
                                    where)
        tools = checked_tools(rec.get("tools"), where)
        if self.media is not None:        # images and audio through the model's processor: (ids, trained, media)
            return self.media.render(messages, tools, where)
        return self._chat(messages, where, tools)

    def _chat(self, messages: list[dict], where: str, tools: list | None = None,
              respond_from: int = 0) -> tuple[list[int], list[bool]]:
        """The conversation through the tokenizer's template; tokens inside an assistant turn's text are trained
        (from message `respond_from` on: a preference pair scores its response, not the prompt's turns)."""
        refuse_media(messages, where, self.fmt)
        text = template_text(self.hf.apply_chat_template, tools, where)
        full, spans = assistant_spans(text, messages, where, respond_from)
        enc = self.hf(full, add_special_tokens=False, return_offsets_mapping=True)
        trained = trained_by_offsets(enc["offset_mapping"], spans, self.train_on_prompt)
        if not any(trained):
            raise BadRecord(f"{where}: no assistant turn to train on (roles {[m['role'] for m in messages]}); "
                             "give each conversation an assistant message")
        return list(enc["input_ids"]), trained
