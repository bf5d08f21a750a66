"""A chat record's messages checked before a template sees them, with every field the template reads.

Chat templates read more than role and content: an assistant's `tool_calls`, a tool result's `tool_call_id`
and `name`, a reasoning model's `reasoning_content`; a record's `tools` (the functions offered) goes to the
template beside the messages. All of it passes through; only what no template can render is refused, with
the record's file:line: a message without a role or with one no template knows, content that is neither text
nor a list of parts, an assistant turn with nothing in it (it would train the end-of-turn token alone).
"""

from __future__ import annotations

__all__ = ["BadRecord", "ROLES", "Where", "checked_messages", "checked_tools", "text_field"]

# the roles chat templates render (OpenAI's, plus Llama 3's ipython and the older function)
ROLES = ("system", "developer", "user", "assistant", "tool", "function", "ipython")


class BadRecord(ValueError):
    """A record bunsan cannot render or mask, said with where it is (data.on_bad_record: skip counts it)."""


class Where(str):
    """Where a record is ("data.jsonl:7"), and the folder its relative media paths resolve against."""

    def __new__(cls, text: str, folder):
        out = super().__new__(cls, text)
        out.folder = folder
        return out

    def __reduce__(self):        # (pickled to tokenize_workers and DataLoader workers with its folder)
        return Where, (str(self), self.folder)


def text_field(value, name: str, key: str, where: str) -> str:
    """A record's text field: a string, never another type turned into text."""
    if not isinstance(value, str):
        raise BadRecord(f"{where}: {key!r} ({name}) is a {type(value).__name__} ({str(value)[:40]!r}), not text; "
                        "fix the record or the column's type")
    return value


def _has_text(content) -> bool:
    if isinstance(content, str):
        return bool(content.strip())
    return isinstance(content, list) and any(p.get("text") or p.get("type") not in (None, "text") for p in content)


def checked_messages(messages, key: str, role_key: str, content_key: str, where: str) -> list[dict]:
    """The conversation as the template takes it: {"role", "content", and every other field of the message}."""
    if not isinstance(messages, list) or not messages:
        raise BadRecord(f"{where}: {key!r} must be a non-empty list of messages, got "
                        f"{type(messages).__name__ if not isinstance(messages, list) else 'an empty list'}")
    out = []
    for k, m in enumerate(messages):
        at = f"{where}: message {k}"
        if not isinstance(m, dict):
            raise BadRecord(f"{at} is a {type(m).__name__}, not an object with {role_key!r} and {content_key!r}")
        role = m.get(role_key)
        if not isinstance(role, str):
            raise BadRecord(f"{at} has no {role_key!r} string (one of {', '.join(ROLES)}); it has {sorted(m)[:6]}")
        if role not in ROLES:
            raise BadRecord(f"{at}: role {role!r} is not one a chat template renders ({', '.join(ROLES)}); rename "
                            "it in the data")
        content = m.get(content_key)
        if content is not None and not isinstance(content, (str, list)):
            raise BadRecord(f"{at}: {content_key!r} is a {type(content).__name__} ({str(content)[:40]!r}); it must be "
                            "text, or a list of content parts")
        if isinstance(content, list) and not all(isinstance(p, dict) for p in content):
            raise BadRecord(f"{at}: {content_key!r} is a list whose items are not content parts ({{type, text}})")
        calls = m.get("tool_calls")
        if calls is not None and (role != "assistant" or not isinstance(calls, list)
                                  or not all(isinstance(c, dict) for c in calls)):
            raise BadRecord(f"{at}: tool_calls must be a list of call objects on an assistant message (role "
                            f"{role!r}, {type(calls).__name__})")
        if role == "assistant" and not calls and not _has_text(content):
            raise BadRecord(f"{at}: an empty assistant turn (no content, no tool_calls) would train only the "
                            "end-of-turn token; drop the message or the record (data.on_bad_record: skip)")
        if role != "assistant" and content is None:
            raise BadRecord(f"{at}: a {role} message without {content_key!r}")
        extra = {f: v for f, v in m.items() if f not in (role_key, content_key)}
        out.append({"role": role, "content": content, **extra})
    return out


def checked_tools(tools, where: str) -> list[dict] | None:
    """A record's `tools` (function definitions), given to the template as transformers' `tools=`."""
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise BadRecord(f"{where}: 'tools' must be a list of tool (function) definitions, got {type(tools).__name__}")
    return tools
