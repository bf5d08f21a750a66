"""DeepSpeed's API over bunsan: `import bunsan.deepspeed as deepspeed` (and `from bunsan.deepspeed.X import ...`
for DeepSpeed's `from deepspeed.X import ...`) is the whole change a DeepSpeed script needs; `install()` (or
`import bunsan.deepspeed.as_deepspeed`) makes `import deepspeed` itself mean this package, for programs that
import DeepSpeed from code you do not edit (transformers' Trainer, accelerate, DeepSpeed-Chat's package).

    initialize, init_distributed, add_config_arguments   initialize.py
    init_inference  a model for generation (TP split)    inference.py
    comm            torch.distributed-style calls          (bunsan/comm/functional.py)
    zero            Init, GatheredParameters, ZeroParamStatus   zero.py (also runtime.zero.partition_parameters)
    pipe            PipelineModule, LayerSpec, TiedLayerSpec   pipe.py
    accelerator     get_accelerator()                      accelerator.py (also at the top level)
    utils           RepeatingLoader, logging.logger, log_dist
    runtime.utils   set_random_seed, see_memory_usage
    runtime.zero.offload_config   OffloadDeviceEnum, OffloadStateTypeEnum
    compression.helper   recursive_getattr / recursive_setattr, convert_conv1d_to_linear
    moe             DeepSpeed's MoE layer (layer.MoE) on bunsan's expert parallelism; utils' group helpers
    checkpointing   activation checkpointing
    ops.adam        FusedAdam, DeepSpeedCPUAdam (torch's Adam/AdamW)

What bunsan does not have (kernel injection, sparse attention, the compression library, ...) is
importable and an error where it is used, never at import (absent.py). README's "Coming from DeepSpeed" lists
what maps to what.
"""

from __future__ import annotations

from bunsan.deepspeed.absent import install_finder as _install_absent

_install_absent()

import bunsan.deepspeed.checkpoint.utils  # noqa: E402,F401  (deepspeed.X.Y reachable as attributes)
import bunsan.deepspeed.moe.layer  # noqa: E402,F401
import bunsan.deepspeed.moe.utils  # noqa: E402,F401
import bunsan.deepspeed.ops.adam  # noqa: E402,F401
import bunsan.deepspeed.runtime.data_pipeline  # noqa: E402,F401
import bunsan.deepspeed.runtime.lr_schedules  # noqa: E402,F401
import bunsan.deepspeed.runtime.utils  # noqa: E402,F401
import bunsan.deepspeed.runtime.zero  # noqa: E402,F401
import bunsan.deepspeed.utils.logging  # noqa: E402,F401
from bunsan.deepspeed import (accelerator, checkpointing, comm, compression, moe, ops, pipe, runtime,  # noqa: E402
                              utils, zero)
from bunsan.deepspeed.accelerator import get_accelerator  # noqa: E402
from bunsan.deepspeed.alias import VERSION, install  # noqa: E402
from bunsan.deepspeed.engine import DeepSpeedEngine, PipelineEngine  # noqa: E402
from bunsan.deepspeed.inference import InferenceEngine, init_inference  # noqa: E402
from bunsan.deepspeed.initialize import add_config_arguments, init_distributed, initialize  # noqa: E402

__version__ = VERSION   # the DeepSpeed release whose API and meaning this mirrors
__all__ = ["initialize", "init_distributed", "init_inference", "add_config_arguments", "get_accelerator", "install",
           "DeepSpeedEngine", "InferenceEngine", "PipelineEngine", "accelerator", "checkpointing", "comm",
           "compression", "moe", "ops", "pipe", "runtime", "utils", "zero"]


def __getattr__(name: str):
    from bunsan.deepspeed.absent import TOP_LEVEL, Absent
    if name in TOP_LEVEL:
        return Absent(f"deepspeed.{name}", TOP_LEVEL[name])
    raise AttributeError(f"module 'bunsan.deepspeed' has no attribute {name!r}")
