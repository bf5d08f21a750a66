"""`deepspeed.accelerator.get_accelerator()`: the device calls DeepSpeed scripts make, over CUDA or the CPU."""

from __future__ import annotations

import os

import torch

__all__ = ["get_accelerator"]


class Accelerator:
    """CUDA when a GPU is visible (or DS_ACCELERATOR=cuda), else the CPU (DS_ACCELERATOR=cpu forces it)."""

    def __init__(self, name: str):
        self._name = name
        self._cuda = name == "cuda"

    def device_name(self, device_index: int | None = None) -> str:
        return self._name if device_index is None else f"{self._name}:{device_index}"

    def current_device(self) -> int:
        return torch.cuda.current_device() if self._cuda else 0

    def current_device_name(self) -> str:
        return f"cuda:{torch.cuda.current_device()}" if self._cuda else "cpu"

    def device(self, device_index: int | None = None) -> torch.device:
        return torch.device(self.device_name(device_index))

    def device_count(self) -> int:
        return torch.cuda.device_count() if self._cuda else 1

    def is_available(self) -> bool:
        return torch.cuda.is_available() if self._cuda else True

    def set_device(self, device_index: int) -> None:
        if self._cuda:
            torch.cuda.set_device(device_index)

    def synchronize(self, device_index: int | None = None) -> None:
        if self._cuda:
            torch.cuda.synchronize(device_index)

    def communication_backend_name(self) -> str:
        return "nccl" if self._cuda else "gloo"

    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_bf16_supported() if self._cuda else True

    def is_fp16_supported(self) -> bool:
        return True

    def manual_seed(self, seed: int) -> None:
        if self._cuda:
            torch.cuda.manual_seed(seed)
        else:
            torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        if self._cuda:
            torch.cuda.manual_seed_all(seed)
        else:
            torch.manual_seed(seed)

    def empty_cache(self) -> None:
        if self._cuda:
            torch.cuda.empty_cache()

    def memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_allocated(device_index) if self._cuda else 0

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.max_memory_allocated(device_index) if self._cuda else 0

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        if self._cuda:
            torch.cuda.reset_peak_memory_stats(device_index)

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        return tensor.pin_memory() if self._cuda else tensor

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self._name

    def Stream(self, *args, **kwargs):   # noqa: N802 (DeepSpeed's name)
        if not self._cuda:
            raise RuntimeError("get_accelerator().Stream() on the CPU: there are no streams; guard the call "
                               "with get_accelerator().device_name() == 'cuda'")
        return torch.cuda.Stream(*args, **kwargs)

    def Event(self, *args, **kwargs):    # noqa: N802
        if not self._cuda:
            raise RuntimeError("get_accelerator().Event() on the CPU: there are no device events")
        return torch.cuda.Event(*args, **kwargs)


def get_accelerator() -> Accelerator:
    forced = os.environ.get("DS_ACCELERATOR")
    if forced not in (None, "", "cuda", "cpu"):
        raise ValueError(f"DS_ACCELERATOR={forced!r}: bunsan runs on 'cuda' or 'cpu'")
    return Accelerator(forced or ("cuda" if torch.cuda.is_available() else "cpu"))
