"""`bunsan serve`: an OpenAI-style completions server on continuous batching (batcher.py, app.py)."""

from bunsan.serve.app import Completion, Limits, build_app
from bunsan.serve.batcher import Batcher, Request, SlotCache

__all__ = ["Batcher", "Completion", "Limits", "Request", "SlotCache", "build_app"]
