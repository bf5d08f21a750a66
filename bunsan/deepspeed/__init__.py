"""DeepSpeed's API over bunsan: `import bunsan.deepspeed as deepspeed` (and `from bunsan.deepspeed.X import ...`
for DeepSpeed's `from deepspeed.X import ...`) is the whole change a DeepSpeed script needs.

    initialize, init_distributed, add_config_arguments   initialize.py
    comm            torch.distributed-style calls          (bunsan/comm/functional.py)
    zero            Init, GatheredParameters              zero.py
    pipe            PipelineModule, LayerSpec, TiedLayerSpec   pipe.py
    accelerator     get_accelerator()                      accelerator.py
    utils           RepeatingLoader, logger, log_dist      utils.py
    runtime.utils   set_random_seed, see_memory_usage
    moe.utils       parameter-group helpers (no experts: MoE layers are an error)
    checkpointing   activation checkpointing
    ops.adam        FusedAdam, DeepSpeedCPUAdam (torch's Adam/AdamW)

What bunsan does not have (MoE layers, 1-bit optimizers, data efficiency) is an error where it is used,
never at import. README's "Coming from DeepSpeed" lists what maps to what.
"""

from __future__ import annotations

import bunsan.deepspeed.moe.layer  # noqa: F401  (deepspeed.moe.utils etc. reachable as attributes)
import bunsan.deepspeed.moe.utils  # noqa: F401
import bunsan.deepspeed.ops.adam  # noqa: F401
import bunsan.deepspeed.runtime.utils  # noqa: F401,E501
from bunsan.deepspeed import accelerator, checkpointing, comm, moe, ops, pipe, runtime, utils, zero
from bunsan.deepspeed.engine import DeepSpeedEngine, PipelineEngine
from bunsan.deepspeed.initialize import add_config_arguments, init_distributed, initialize

__version__ = "0.19.8"   # the DeepSpeed release whose API and meaning this mirrors
__all__ = ["initialize", "init_distributed", "add_config_arguments", "DeepSpeedEngine", "PipelineEngine",
           "accelerator", "checkpointing", "comm", "moe", "ops", "pipe", "runtime", "utils", "zero"]
