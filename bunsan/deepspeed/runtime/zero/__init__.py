"""`deepspeed.runtime.zero`: Init and GatheredParameters (as `deepspeed.zero`), partition_parameters'
ZeroParamStatus, offload_config's enums."""

from bunsan.deepspeed.runtime.zero import offload_config, partition_parameters
from bunsan.deepspeed.zero import GatheredParameters, Init

__all__ = ["GatheredParameters", "Init", "offload_config", "partition_parameters"]
