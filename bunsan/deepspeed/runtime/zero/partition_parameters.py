"""`deepspeed.runtime.zero.partition_parameters`: ZeroParamStatus, Init and GatheredParameters.

Under ZeRO-3 every parameter of a bunsan.deepspeed engine carries DeepSpeed's `ds_id`, `ds_status`,
`ds_shape` and `ds_numel` (zero.py), so the common test `hasattr(p, "ds_id") and p.ds_status ==
ZeroParamStatus.NOT_AVAILABLE` picks the parameters to gather with GatheredParameters, as in DeepSpeed."""

from __future__ import annotations

import torch

from bunsan.deepspeed.zero import GatheredParameters, Init
from bunsan.deepspeed.zero_status import ZeroParamStatus

__all__ = ["GatheredParameters", "Init", "ZeroParamStatus", "zero_wrapper_for_fp_tensor_constructor"]

# DeepSpeed's Init wraps torch's tensor constructors to cast what a model builds to the config's dtype;
# transformers' from_pretrained patches that wrapper (prevent_arange_dtype_change). bunsan's Init wraps no
# constructor (the model keeps the dtypes its code builds; the engine casts at initialize), so the wrapper is
# never applied: these are here for code that reads or patches them.
_orig_torch_arange = torch.arange


def zero_wrapper_for_fp_tensor_constructor(fn, target_fp_dtype=None, target_device=None):
    return fn
