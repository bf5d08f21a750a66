"""Preference pairs for DPO (data.format preference, train.objective dpo): records as TRL keeps them.

    {"prompt": "2+2=", "chosen": "4", "rejected": "5"}                                  text
    {"prompt": [messages], "chosen": [assistant messages], "rejected": [...]}           conversational
    {"messages": [messages], "chosen": "...", "rejected": "..."}                         (prompt as messages)

A conversational pair goes through the tokenizer's chat template (every message field, as chat records);
only the response's tokens are scored. Each pair becomes two rows, chosen then rejected, kept side by side
by the batches (a window of two rows). The reference log-probs are the model's before training
(dpo.reference initial: `reference_logps`, every rank's share of the pairs, summed over the data-parallel
group), or the records' own `ref_chosen_logps` / `ref_rejected_logps` (dpo.reference records).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from bunsan.training.chat_records import BadRecord, checked_messages, checked_tools, text_field
from bunsan.training.example_batches import ExampleRows

__all__ = ["render_pair", "pair_rows", "reference_logps", "REF_FIELDS"]

REF_FIELDS = ("ref_chosen_logps", "ref_rejected_logps")


def _response(renderer, value, name: str, where: str) -> list[dict] | str:
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        value = [value]
    messages = checked_messages(value, renderer.fields[name], renderer.fields["role"], renderer.fields["content"],
                                where)
    if any(m["role"] != "assistant" for m in messages):
        raise BadRecord(f"{where}: {renderer.fields[name]!r} must be the assistant's response (text or assistant "
                        f"messages), it has roles {[m['role'] for m in messages]}")
    return messages


def render_pair(renderer, rec: dict, where: str):
    """((chosen ids, scored), (rejected ids, scored)) of one preference record."""
    chosen = _response(renderer, renderer._field(rec, "chosen", where, text=False), "chosen", where)
    rejected = _response(renderer, renderer._field(rec, "rejected", where, text=False), "rejected", where)
    key = renderer.fields["messages"] if renderer.fields["messages"] in rec else renderer.fields["prompt"]
    prompt = renderer._field(rec, "messages" if key == renderer.fields["messages"] else "prompt", where, text=False)
    conversational = isinstance(prompt, list) or isinstance(chosen, list) or isinstance(rejected, list)
    if not conversational:
        text_field(prompt, "prompt", key, where)
        ids = renderer.tokenizer.encode(prompt)
        return tuple(_scored(ids, renderer.tokenizer.encode(r) + renderer.eos) for r in (chosen, rejected))
    if renderer.hf is None:
        raise BadRecord(f"{where}: a conversational preference pair renders through the tokenizer's chat template, "
                        "and the tokenizer has none; set data.tokenizer to one with a chat_template")
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    else:
        prompt = checked_messages(prompt, key, renderer.fields["role"], renderer.fields["content"], where)
    tools = checked_tools(rec.get("tools"), where)
    out = []
    for response in (chosen, rejected):
        turn = [{"role": "assistant", "content": response}] if isinstance(response, str) else response
        out.append(renderer._chat(prompt + turn, where, tools, respond_from=len(prompt)))
    return tuple(out)


def _scored(prompt: list[int], response: list[int]) -> tuple[list[int], list[bool]]:
    return prompt + response, [False] * len(prompt) + [True] * len(response)


def _record_reference(rec, where: str) -> list[float]:
    values = [rec.get(f) for f in REF_FIELDS]
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in values):
        raise BadRecord(f"{where}: dpo.reference records reads {list(REF_FIELDS)} from each record (the reference "
                        f"model's summed log-probs of the two responses), got {values}")
    return [float(v) for v in values]


def pair_rows(records, renderer, seq_len: int, pad_id: int, reference: str) -> ExampleRows:
    """Every pair as two rows of seq_len + 1 tokens, interleaved (chosen, rejected), padded; a pair whose response
    is cut away from either row is left out (said)."""
    w = seq_len + 1
    ids, trained, ref, cut, dropped, skipped, used = [], [], [], 0, 0, [], 0
    for where, rec in records:
        try:
            pair = renderer.render_or_skip(rec, where)
            values = _record_reference(rec, where) if reference == "records" and pair[0] is not None else None
        except BadRecord as e:
            if renderer.on_bad_record != "skip":
                raise
            pair, values = (None, str(e)), None
        if pair[0] is None:
            skipped.append(pair[1])
            continue
        rows = []
        for toks, mask in pair:
            if len(toks) > w:
                toks, mask, cut = toks[:w], mask[:w], cut + 1
            rows.append((list(toks) + [pad_id] * (w - len(toks)), [False] + list(mask[1:]) + [False] * (w - len(toks))))
        if not all(any(m) for _, m in rows):
            dropped += 1
            continue
        used += 1
        for row, mask in rows:
            ids.append(row)
            trained.append(mask)
        ref += values or []
    if not ids:
        raise ValueError(f"no preference pair has a response to score within seq_len+1 = {w} tokens ({dropped} "
                         f"left out{f', {len(skipped)} skipped, e.g. {skipped[0]}' if skipped else ''}); check "
                         "data.fields, or raise data.seq_len")
    dtype = np.int32 if max(max(r) for r in ids) < 2 ** 31 else np.int64
    return ExampleRows(np.asarray(ids, dtype=dtype), np.asarray(trained, dtype=bool), cut, dropped, skipped, None,
                       used, pairs=True, ref_logps=np.asarray(ref, dtype=np.float64) if ref else None)


def reference_logps(engine, rows: ExampleRows, target_key: str = "labels") -> np.ndarray:
    """Each row's summed log-prob of its scored tokens under the engine's model as it is now (before training):
    every data-parallel rank scores an equal share of the pairs (padded: ZeRO-3's gathers are collectives)."""
    from bunsan.engine.preference import sequence_logps
    n_pairs = rows.ids.shape[0] // 2
    dp, rank = engine.dp_size, engine.dp_rank
    per_call = max(1, engine.micro_batch // 2)
    mine = list(range(rank, n_pairs, dp))
    calls = math.ceil(math.ceil(n_pairs / dp) / per_call)
    out = torch.zeros(2 * n_pairs, dtype=torch.float64, device=engine.device)
    labels = np.where(rows.trained, rows.ids, -100)
    for c in range(calls):
        chunk = mine[c * per_call:(c + 1) * per_call] or [0]       # (a rank out of pairs scores pair 0 again)
        at = np.array([[2 * p, 2 * p + 1] for p in chunk]).reshape(-1)
        ids = torch.from_numpy(rows.ids[at].astype(np.int64))
        lab = torch.from_numpy(labels[at].astype(np.int64))
        got = sequence_logps(engine, {"input_ids": ids[:, :-1], target_key: lab[:, 1:]})
        if mine[c * per_call:(c + 1) * per_call]:
            out[torch.from_numpy(at).to(out.device)] = got.to(out)
    # each dp rank wrote its own pairs (its context-parallel ranks the same values): summed over dp only
    engine.comm.all_reduce(out, engine.mesh.dp_group)
    return out.cpu().numpy()
