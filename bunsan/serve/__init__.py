"""`bunsan serve`: OpenAI- and Ollama-compatible completions on continuous batching (batcher.py over the paged
KV cache of paged.py, its blocks and prefix cache in blocks.py), its HTTP endpoints (app.py, openai_routes.py,
ollama_routes.py) and what a request may be (body.py, requests.py, errors.py)."""

from bunsan.serve.app import Service, build_app
from bunsan.serve.batcher import Batcher, Request
from bunsan.serve.chat import ChatTemplate
from bunsan.serve.requests import Limits
from bunsan.serve.paged import PagedCache

__all__ = ["Batcher", "ChatTemplate", "Limits", "Request", "PagedCache", "Service", "build_app"]
