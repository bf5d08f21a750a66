"""`deepspeed.init_inference`: a built model made ready for generation, in DeepSpeed's call.

    engine = deepspeed.init_inference(model, tensor_parallel={"tp_size": 2}, dtype=torch.half)
    out = engine.generate(input_ids, max_new_tokens=20)      # the model's own generate, on the split model

With tp_size > 1 every rank keeps 1/tp of each attention and MLP projection (the model's tensor-parallel plan:
transformers' `base_model_tp_plan`, or bunsan's Llama's), the vocabulary head gathers the logits, and every
rank returns the same tokens; bunsan's `generate --tp` and `serve --tp` run the same split. DeepSpeed's fused
kernels (`replace_with_kernel_inject`) are not built: the plain modules compute the same values, so the flag is
accepted and ignored with a warning. What changes results (int8, loading a checkpoint here) is an error.
"""

from __future__ import annotations

import logging

import torch
import torch.nn as nn

from bunsan.comm.collectives import Comm
from bunsan.comm.mesh import Mesh
from bunsan.comm.process_group import init_distributed
from bunsan.tensor_parallel import TPContext, apply_tensor_parallel

__all__ = ["InferenceEngine", "init_inference"]

log = logging.getLogger("bunsan.deepspeed")

DTYPES = {torch.float32: torch.float32, torch.float16: torch.float16, torch.bfloat16: torch.bfloat16,
          "fp32": torch.float32, "float32": torch.float32, "float": torch.float32, "fp16": torch.float16,
          "float16": torch.float16, "half": torch.float16, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}
# keys that only tune DeepSpeed's kernels: the values computed are the same without them
SPEED_ONLY = {"replace_with_kernel_inject", "kernel_inject", "enable_cuda_graph", "max_out_tokens", "min_out_tokens",
              "triangular_masking", "return_tuple", "use_triton", "triton_autotune", "injection_policy",
              "replace_method", "transposed_mode", "keep_module_on_host", "set_empty_params", "max_tokens"}
REFUSED = {"checkpoint": "load the weights into the model first (from_pretrained or load_state_dict)",
           "base_dir": "load the weights into the model first", "save_mp_checkpoint_path": "save with the model's "
           "own save_pretrained", "quant": "int8 inference is not built; use dtype fp16 or bf16",
           "moe": "MoE inference is not built", "zero": "ZeRO-Inference is not built; use dtype fp16/bf16 and TP"}


def _options(config, kwargs: dict) -> dict:
    options = dict(config or {})
    options.update(kwargs)
    if "mp_size" in options:             # DeepSpeed's older spelling
        options.setdefault("tensor_parallel", {"tp_size": options.pop("mp_size")})
    tp = options.pop("tensor_parallel", None) or {}
    if not isinstance(tp, dict):
        tp = {"tp_size": getattr(tp, "tp_size", 1)}
    options["tp_size"] = int(tp.get("tp_size", 1))
    for key in REFUSED:
        if options.get(key) not in (None, False, {}, ""):
            raise ValueError(f"init_inference({key}=...): {REFUSED[key]}")
        options.pop(key, None)
    ignored = sorted(k for k in options if k in SPEED_ONLY and options[k] not in (None, False))
    if ignored:
        log.warning("init_inference: %s accepted and ignored: DeepSpeed's fused kernels are not built in bunsan; "
                    "the plain modules compute the same values", ", ".join(ignored))
    unknown = sorted(set(options) - SPEED_ONLY - {"tp_size", "dtype"})
    if unknown:
        raise TypeError(f"init_inference got {unknown}, which bunsan does not know; it takes tensor_parallel "
                        "(tp_size), mp_size, dtype and DeepSpeed's kernel switches")
    return options


class InferenceEngine(nn.Module):
    """What init_inference returns: the model (`.module`), called and generating as itself."""

    def __init__(self, module: nn.Module, tp_size: int):
        super().__init__()
        self.module = module
        self.tp_size = tp_size

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @torch.no_grad()
    def generate(self, *args, **kwargs):
        if not hasattr(self.module, "generate"):
            raise AttributeError(f"{type(self.module).__name__} has no generate(); call the engine for logits")
        return self.module.generate(*args, **kwargs)


def init_inference(model: nn.Module, config=None, **kwargs) -> InferenceEngine:
    options = _options(config, kwargs)
    dtype = options.get("dtype")
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"init_inference(dtype={dtype!r}): bunsan runs fp32, fp16 or bf16 (int8 is not built)")
    tp = options["tp_size"]
    if tp < 1:
        raise ValueError(f"tensor_parallel.tp_size {tp} must be 1 or more")
    device = init_distributed() if tp > 1 else (torch.device(f"cuda:{torch.cuda.current_device()}")
                                                 if torch.cuda.is_available() else torch.device("cpu"))
    model.to(device=device, dtype=DTYPES[dtype] if dtype is not None else None)
    model.eval()
    if tp > 1:
        mesh = Mesh.create(tp=tp)
        head = apply_tensor_parallel(model, TPContext(Comm(device=device), mesh.tp_group))
        if head is not None:
            head.gather_output = True    # every rank samples from the whole vocabulary
    return InferenceEngine(model, tp)
