"""Chat records as people keep them: tool calls, tool results and the tools offered reach the template (the
mask then trains the call exactly as the template writes it), and a record bunsan cannot render is refused
naming its file:line, or skipped and counted with data.on_bad_record: skip."""

from __future__ import annotations

import json

import pytest

transformers = pytest.importorskip("transformers")

from bunsan.training.chat_records import BadRecord  # noqa: E402
from bunsan.training.example_batches import example_rows  # noqa: E402
from bunsan.training.examples import Renderer, read_records  # noqa: E402
from bunsan.training.tokenizer import load_tokenizer  # noqa: E402
from chat_tokenizer import save_chat_tokenizer  # noqa: E402

# A ChatML template that writes tool calls, tool results and the offered tools (as Qwen 2.5's does, shorter)
TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n{{ m.content or '' }}"
    "{%- for c in m.tool_calls %}<tool_call>{{ c.function.name }} {{ c.function.arguments | tojson }}</tool_call>"
    "{%- endfor %}<|im_end|>\n"
    "{%- elif m.role == 'tool' %}<|im_start|>tool\n{{ m.name }} {{ m.tool_call_id }}: {{ m.content }}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

TOOL_CHAT = {"tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}],
             "messages": [
                 {"role": "user", "content": "Weather in Rome?"},
                 {"role": "assistant", "content": None, "tool_calls": [
                     {"id": "c1", "type": "function", "function": {"name": "get_weather",
                                                                   "arguments": {"city": "Rome"}}}]},
                 {"role": "tool", "tool_call_id": "c1", "name": "get_weather", "content": "22C"},
                 {"role": "assistant", "content": "It is 22C."}]}


@pytest.fixture(scope="module")
def chatml(tmp_path_factory):
    d = tmp_path_factory.mktemp("chatml")
    save_chat_tokenizer(d)
    return d


@pytest.fixture(scope="module")
def with_tools(tmp_path_factory):
    d = tmp_path_factory.mktemp("tools")
    save_chat_tokenizer(d)
    config = json.loads((d / "tokenizer_config.json").read_text())
    config["chat_template"] = TOOLS_TEMPLATE
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    (d / "chat_template.jinja").unlink(missing_ok=True)
    return d


def _trained_text(tok, ids, trained):
    return tok.decode([i for i, t in zip(ids, trained) if t])


def test_tool_calls_results_and_tools_reach_the_template_and_the_call_is_trained(with_tools):
    tok = load_tokenizer(with_tools)
    r = Renderer("chat", tok, with_tools, {}, train_on_prompt=False)
    ids, trained = r.render(TOOL_CHAT, "chat.jsonl:1")
    want = r.hf.apply_chat_template(TOOL_CHAT["messages"], tools=TOOL_CHAT["tools"], tokenize=False)
    assert tok.decode(ids) == want
    assert "get_weather c1: 22C" in want and "Tools: [" in want
    assert _trained_text(tok, ids, trained) == \
        '<tool_call>get_weather {"city": "Rome"}</tool_call><|im_end|>It is 22C.<|im_end|>'   # as the template writes


def test_a_template_that_cannot_write_tool_calls_is_refused_not_trained_empty(chatml):
    r = Renderer("chat", load_tokenizer(chatml), chatml, {}, train_on_prompt=False)
    with pytest.raises(BadRecord, match=r"chat.jsonl:7: .*does not render tool_calls"):
        r.render(TOOL_CHAT, "chat.jsonl:7")


def _chat(*messages):
    return {"messages": list(messages)}


USER = {"role": "user", "content": "hi"}
BAD = {
    "unknown role": (_chat(USER, {"role": "wizard", "content": "x"}), r"role 'wizard' is not one"),
    "empty assistant": (_chat(USER, {"role": "assistant", "content": ""}), "an empty assistant turn"),
    "no role": (_chat({"content": "hi"}), "has no 'role'"),
    "number content": (_chat(USER, {"role": "assistant", "content": 12345}), r"'content' is a int \('12345'\)"),
    "opens with the assistant": (_chat({"role": "assistant", "content": "hello"}, USER), "opens with the assistant"),
    "not a list": ({"messages": "hi"}, "must be a non-empty list"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_record_that_cannot_be_rendered_is_refused_naming_where(chatml, case):
    record, message = BAD[case]
    r = Renderer("chat", load_tokenizer(chatml), chatml, {}, train_on_prompt=False)
    with pytest.raises(BadRecord, match=r"data.jsonl:3: .*" + message):
        r.render(record, "data.jsonl:3")


def test_a_non_text_field_is_refused_not_turned_into_text(chatml):
    r = Renderer("prompt_completion", load_tokenizer(chatml), None, {}, train_on_prompt=False)
    with pytest.raises(BadRecord, match=r"rows.parquet row 4: 'completion' \(completion\) is a float"):
        r.render({"prompt": "2+2=", "completion": 4.0}, "rows.parquet row 4")


def test_bad_records_are_skipped_and_counted_on_request(chatml, tmp_path):
    good = _chat(USER, {"role": "assistant", "content": "hello"})
    lines = [json.dumps(good), json.dumps(BAD["unknown role"][0]), "{not json", json.dumps(good),
             json.dumps(BAD["empty assistant"][0])]
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(lines) + "\n")
    tok = load_tokenizer(chatml)
    strict = Renderer("chat", tok, chatml, {}, False)
    with pytest.raises(BadRecord, match=rf"{path}:2: .*role 'wizard'"):
        example_rows(read_records([path]), strict, 64, 0)
    lenient = Renderer("chat", tok, chatml, {}, False, on_bad_record="skip")
    rows = example_rows(read_records([path], "skip"), lenient, 64, 0)
    assert rows.examples == 2 and len(rows.skipped) == 3
    assert [why.split(": ")[0] for why in rows.skipped] == [f"{path}:2", f"{path}:3", f"{path}:5"]
