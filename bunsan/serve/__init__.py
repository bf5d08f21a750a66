"""`bunsan serve`: an OpenAI-style completions server on continuous batching (batcher.py), its HTTP endpoints
(app.py) and what a request may be (requests.py)."""

from bunsan.serve.app import build_app
from bunsan.serve.batcher import Batcher, Request, SlotCache
from bunsan.serve.requests import Completion, Limits

__all__ = ["Batcher", "Completion", "Limits", "Request", "SlotCache", "build_app"]
