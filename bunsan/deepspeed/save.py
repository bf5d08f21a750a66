"""`save_16bit_model`: the whole model in its training dtype, one safetensors file written by rank 0."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from safetensors.torch import save_file

log = logging.getLogger("bunsan.deepspeed")


def save_model(engine, save_dir, save_filename: str) -> Path:
    """Collective (every rank gathers); returns the path rank 0 wrote. DeepSpeed writes a torch pickle; bunsan
    writes no pickles, so a '.bin' (or any other) name becomes '<stem>.safetensors'."""
    name = Path(save_filename)
    if name.suffix != ".safetensors":
        log.warning("save_16bit_model(%r): bunsan writes safetensors, not pickles; saving %s (load it with "
                    "safetensors.torch.load_file)", save_filename, name.with_suffix(".safetensors").name)
        name = name.with_suffix(".safetensors")
    state = engine.consolidated_state_dict()
    path = Path(save_dir) / name
    if engine.mesh.rank == 0:
        seen, out = set(), {}
        for key, t in state.items():
            t = t.detach().to(engine.dtype).contiguous()
            if t.data_ptr() in seen:     # tied weights: safetensors stores each tensor once
                t = t.clone()
            seen.add(t.data_ptr())
            out[key] = t
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        save_file(out, str(tmp), metadata={"format": "pt"})
        os.replace(tmp, path)       # readers never see half a file
    if engine.mesh.world.size > 1:
        engine.comm.barrier(engine.mesh.world)
    return path
