"""A transformers model split as the engine splits it, for the estimator and the planner.

Tensor parallelism: the engine's own split (tensor_parallel/plan.py: the model's `base_model_tp_plan` and its
head's `_tp_plan`, translated by hf_plan.py, a composite model's CLIP, SigLIP or Whisper-style towers split
too) is applied to a copy of the meta model, as one rank of the group holds it. Every parameter's per-rank
shape is then the engine's (q/k/v and gate/up by rows with their biases, o_proj and down_proj by columns,
the embedding and head by vocabulary padded to a multiple of tp, norms whole), and a model the engine
refuses is refused with the engine's own words: GPT-2 ships no plan, Gemma's scaled embedding is not a
plain nn.Embedding. Nothing is allocated (the meta device) and a copy costs well under a second at 72B.

Pipeline parallelism needs no copy: rank_params cuts the model with the engine's partitioner
(pipeline/partition.py: embedding and any encoders with the first blocks, the norm and head with the last).
"""

from __future__ import annotations

import copy
import warnings
import weakref

import torch.nn as nn

# styles that leave every rank a block's whole activations (Phi-3's fused qkv and gate_up are
# colwise_gather_output: each rank gathers all heads back), which a Llama split's activations at tp do not price
GATHERING_STYLES = ("column_gather", "row_split_input")

_SPLIT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()    # module -> {(tp, encoders): copy or error}


def split_module(module: nn.Module, tp: int, encoders: str = "split", llama_activations: bool = False) -> nn.Module:
    """A meta copy of the transformers `module` as a rank of `tp` tensor-parallel ranks holds it after the
    engine's split (rank 0: every rank holds the same shapes). `llama_activations`: its activations are priced
    as a Llama block's at tp, so a plan that gathers a block's heads back is refused. A ValueError says why the
    engine (or the pricing) refuses it."""
    cache = _SPLIT.setdefault(module, {})
    key = (tp, encoders, llama_activations)
    if key not in cache:
        try:
            cache[key] = _split(module, tp, encoders, llama_activations)
        except ValueError as e:
            cache[key] = e
    out = cache[key]
    if isinstance(out, ValueError):
        raise ValueError(str(out)) from None
    return out


def _split(module: nn.Module, tp: int, encoders: str, llama_activations: bool) -> nn.Module:
    from bunsan.comm.collectives import Comm
    from bunsan.comm.work import Group
    from bunsan.tensor_parallel.hf_plan import is_hf_model
    from bunsan.tensor_parallel.ops import TPContext
    from bunsan.tensor_parallel.plan import apply_tensor_parallel, check_plan_matches, resolve_plan
    name = type(module).__name__
    if not is_hf_model(module):
        raise ValueError(f"the estimator knows the tensor-parallel split of bunsan's Llama and of transformers "
                         f"models; {name} is neither: estimate it with tp 1")
    held = copy.deepcopy(module)          # (on meta: the modules are copied, no tensor is allocated)
    # (no communication happens while layers are swapped: a group with no process group is enough)
    ctx = TPContext(Comm(), Group("tp", None, tp, 0, tuple(range(tp))), encoders=encoders)
    with warnings.catch_warnings():       # (a tower kept whole is priced whole; the engine warns at run time)
        warnings.simplefilter("ignore")
        try:
            plan = resolve_plan(held, ctx, None)
            check_plan_matches(held, plan)
        except ValueError as e:     # (its words name the model; at tp 1 only what any size meets is refused)
            raise ValueError(str(e) if tp == 1 else f"{name} under tensor parallelism {tp}: {e}") from None
        gathering = sorted(p for p, s in plan.items() if s in GATHERING_STYLES)
        if llama_activations and gathering:
            raise ValueError(f"{name} under tensor parallelism: its plan gathers {', '.join(gathering)} back whole on "
                             "every rank, so its blocks' activations are not a Llama block's split over tp; price "
                             "it with tp 1")
        try:
            apply_tensor_parallel(held, ctx, plan, stage_only=True)
        except ValueError as e:
            raise ValueError(f"the engine does not split {name}" + (f" over {tp} ranks" if tp > 1 else "")
                             + f": {e}") from None
    return held


def tp_refusal(module: nn.Module, llama_activations: bool) -> str | None:
    """Why the engine cannot split this transformers model at any tensor-parallel size (no plan, a layer its
    styles cannot split), or None: the split at size 1 meets every refusal that does not depend on the size."""
    try:
        split_module(module, 1, llama_activations=llama_activations)
    except ValueError as e:
        return str(e)
    return None


def pp_refusal(module: nn.Module) -> str | None:
    """Why the engine's pipeline cannot cut this model into stages, or None."""
    from bunsan.pipeline.partition import model_layers
    try:
        model_layers(module)
    except ValueError as e:
        return str(e)
    return None


def pipeline_blocks(module: nn.Module) -> int:
    """The repeated layers the engine's uniform partition deals out to stages (a transformers decoder's)."""
    from bunsan.pipeline.partition import model_layers
    return sum(layer.repeated for layer in model_layers(module))
