"""A transformers causal LM that is not a Llama (Qwen2/3, Mistral, Gemma, Phi-3, GPT-2, ...) spread over
devices, CPU and disk for `bunsan generate` and `bunsan serve --device-map`: transformers' own device_map
(Accelerate's placement and hooks, which move each block's inputs to it and stream offloaded weights), with
the same map names and --max-memory budgets as bunsan's Llama placement (load.py)."""

from __future__ import annotations

import tempfile
from collections import Counter
from pathlib import Path

import torch

from bunsan.memory.measure import host_available_bytes
from bunsan.models.hf import input_device, pretrained_lm


def load_placed(path, device_map: str, max_memory: dict | None, dtype: torch.dtype | None):
    """The model of the Hugging Face directory `path`, placed by `device_map` ("auto", "balanced",
    "sequential") within `max_memory` ({gpu index or "cpu": bytes}; default: the CPU only, as bunsan's Llama
    placement). Blocks past every budget go to disk (a temporary offload folder)."""
    budgets = dict(max_memory) if max_memory else {"cpu": host_available_bytes()}
    unknown = sorted(str(k) for k in budgets if not (isinstance(k, int) or k == "cpu"))
    if unknown:
        raise ValueError(f"--max-memory keys {unknown} are not devices; name GPU indices and cpu, e.g. "
                         "0=20GiB,cpu=64GiB (what does not fit goes to disk)")
    offload = tempfile.mkdtemp(prefix="bunsan-offload-")
    model = pretrained_lm(
        Path(path), dtype=dtype or torch.float32, device_map=device_map, max_memory=budgets,
        offload_folder=offload).eval()
    # Accelerate cannot read back every placement from disk (a buffer built with the model, a weight tied
    # across modules on disk): one token through the model says so now, not at the first request
    try:
        with torch.no_grad():
            model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=input_device(model)))
    except NotImplementedError as e:
        raise ValueError(f"this placement of {model.config.model_type} ({where(model)}) cannot run under "
                         f"Accelerate ({e}): give --max-memory's CPU (or a GPU) more, so less goes to disk") from None
    return model



def placement_line(model) -> str:
    """Where the model's modules went, e.g. 'device map: cpu 14 modules, disk 3 modules'."""
    return f"device map: {where(model)}"


def where(model) -> str:
    counts = Counter(str(d) for d in getattr(model, "hf_device_map", {}).values())
    if len(counts) <= 1:                # transformers keeps no map when one device holds everything
        return f"the whole model on {next(iter(counts), next(model.parameters()).device)}"
    return ", ".join(f"{d} {n} module{'s' * (n != 1)}" for d, n in sorted(counts.items()))
