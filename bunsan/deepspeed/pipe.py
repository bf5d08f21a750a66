"""`deepspeed.pipe`: a model given as a list of layers (`LayerSpec`s built only where they run, shared
`TiedLayerSpec`s, modules, plain callables), cut into `num_stages` by bunsan's pipeline.

A PipelineModule is an nn.Sequential whose children are the layers, so bunsan's pipeline cuts it like any
Sequential (pipeline/partition.py) and parameter names are "<layer index>.<name>". LayerSpec layers are
built on the meta device first (no memory); the rank that holds one builds it for real, with its own
init, when its stage is materialised, and copies the weights in by name (init_parameter / init_buffer).

Each LayerSpec is built under the seed `base_seed + its index` (DeepSpeed's `seed_layers=True`), whatever
`seed_layers` says: the weights then do not depend on how the layers are partitioned, so any number of
stages (and a single process) trains the same model. DeepSpeed's default draws layers from one running
generator per rank, so its weights change with the partition.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn

__all__ = ["PipelineModule", "LayerSpec", "TiedLayerSpec"]

PARTITION_METHODS = {"parameters": "parameters", "uniform": "uniform"}


class LayerSpec:
    """A layer not built yet: `LayerSpec(nn.Linear, 10, 10)` builds `nn.Linear(10, 10)` where it runs."""

    def __init__(self, typename: type, *module_args, **module_kwargs):
        if not (isinstance(typename, type) and issubclass(typename, nn.Module)):
            raise TypeError(f"LayerSpec needs an nn.Module subclass, got {typename!r}")
        self.typename, self.module_args, self.module_kwargs = typename, module_args, module_kwargs

    def build(self, log: bool = False) -> nn.Module:
        return self.typename(*self.module_args, **self.module_kwargs)

    def __repr__(self) -> str:
        return f"LayerSpec({self.typename.__name__})"


class TiedLayerSpec(LayerSpec):
    """A layer whose module is shared by every TiedLayerSpec with the same `key` (an embedding reused as the
    output head); `forward_fn(module, x)` runs it at this position when given."""

    def __init__(self, key: str, typename: type, *module_args, forward_fn: Callable | None = None,
                 tied_weight_attr="weight", **module_kwargs):
        super().__init__(typename, *module_args, **module_kwargs)
        self.key, self.forward_fn, self.tied_weight_attr = key, forward_fn, tied_weight_attr


class _Lambda(nn.Module):
    """A plain function in the layer list (`lambda x: x.flatten(1)`)."""

    def __init__(self, fn: Callable):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


class _Tied(nn.Module):
    """One position of a tied module: the shared module, run directly or through forward_fn."""

    def __init__(self, module: nn.Module, forward_fn: Callable | None):
        super().__init__()
        self.module, self.forward_fn = module, forward_fn

    def forward(self, x):
        return self.forward_fn(self.module, x) if self.forward_fn is not None else self.module(x)


def _partition_method(method: str) -> str:
    key = str(method).lower()
    if key not in PARTITION_METHODS:
        raise ValueError(f"partition_method {method!r} is not supported; use 'parameters' (balance parameter "
                         "counts) or 'uniform' (balance layer counts); DeepSpeed's 'type:<regex>' is not built")
    return PARTITION_METHODS[key]


class PipelineModule(nn.Sequential):
    def __init__(self, layers, num_stages: int | None = None, topology=None, loss_fn: Callable | None = None,
                 seed_layers: bool = False, seed_fn: Callable | None = None, base_seed: int = 1234,
                 partition_method: str = "parameters", activation_checkpoint_interval: int = 0,
                 activation_checkpoint_func=None, checkpointable_layers=None, dynamic_shape: bool = False):
        if topology is not None:
            raise ValueError("PipelineModule(topology=...): bunsan lays out the mesh itself (pipeline x data x "
                             "tensor parallel); pass num_stages, and tensor_parallel.size in the config")
        if num_stages is None or num_stages < 1:
            raise ValueError(f"PipelineModule needs num_stages >= 1, got {num_stages!r}")
        if activation_checkpoint_interval:
            raise ValueError(f"activation_checkpoint_interval={activation_checkpoint_interval}: recomputing "
                             "pipeline layers is not supported for a PipelineModule; set it to 0")
        super().__init__()
        self.num_stages, self.base_seed = num_stages, base_seed
        object.__setattr__(self, "loss_fn", loss_fn)   # not a child: the children are the layers, in order
        self.partition_method = _partition_method(partition_method)
        self._seed_fn = seed_fn
        self._specs: dict[int, LayerSpec] = {}       # layer index -> the spec that builds it (tied: first index)
        self._tied_at: dict[str, int] = {}            # tie key -> the index of its first spec
        tied: dict[str, nn.Module] = {}
        for i, layer in enumerate(layers):
            self.add_module(str(i), self._layer(i, layer, tied))
        meta = any(t.is_meta for t in self.parameters()) or any(b.is_meta for b in self.buffers())
        # modules given built: their values, for the rebuild by name after a stage's to_empty
        self._built_values = {str(i): {k: v.detach().clone() for k, v in m.state_dict().items()}
                              for i, m in enumerate(self) if meta and str(i) not in self._spec_names()}
        self._last_built: tuple[int, nn.Module] | None = None

    def _spec_names(self) -> set[str]:
        return {str(i) for i in self._specs} | {str(i) for i, m in enumerate(self) if isinstance(m, _Tied)}

    def _layer(self, i: int, layer, tied: dict) -> nn.Module:
        if isinstance(layer, TiedLayerSpec):
            if layer.key not in tied:
                tied[layer.key], self._tied_at[layer.key] = self._on_meta(layer), i
                self._specs[i] = layer
            return _Tied(tied[layer.key], layer.forward_fn)
        if isinstance(layer, LayerSpec):
            self._specs[i] = layer
            return self._on_meta(layer)
        if isinstance(layer, nn.Module):
            return layer
        if callable(layer):
            return _Lambda(layer)
        raise TypeError(f"PipelineModule layer {i} is a {type(layer).__name__}; use a LayerSpec, TiedLayerSpec, "
                        "nn.Module or a callable taking and returning one tensor")

    @staticmethod
    def _on_meta(spec: LayerSpec) -> nn.Module:
        with torch.device("meta"):
            return spec.build()

    def _real(self, i: int) -> nn.Module:
        """Layer i's spec built for real under its own seed (the last one kept: stages fill layer by layer)."""
        if self._last_built is None or self._last_built[0] != i:
            with torch.random.fork_rng(devices=[]):
                (self._seed_fn or torch.manual_seed)(self.base_seed + i)
                self._last_built = (i, self._specs[i].build())
        return self._last_built[1]

    def _value(self, name: str, kind: str) -> torch.Tensor:
        index, _, rest = name.partition(".")
        child = self[int(index)]
        if isinstance(child, _Tied):
            rest = rest.removeprefix("module.")
            key = next(k for k, at in self._tied_at.items() if isinstance(self[at], _Tied)
                       and self[at].module is child.module)
            source = self._real(self._tied_at[key])
        elif int(index) in self._specs:
            source = self._real(int(index))
        else:
            return self._built_values[index][rest]
        return source.get_parameter(rest) if kind == "parameter" else source.get_buffer(rest)

    @torch.no_grad()
    def init_parameter(self, name: str, tensor: torch.Tensor, seed: int = 0) -> None:
        tensor.copy_(self._value(name, "parameter"))

    @torch.no_grad()
    def init_buffer(self, name: str, tensor: torch.Tensor) -> None:
        tensor.copy_(self._value(name, "buffer"))

    def init_buffers(self) -> None:
        for name, b in self.named_buffers():
            self.init_buffer(name, b)

    def init_weights(self, seed: int | None = None) -> None:
        """Every parameter and buffer from its layer's own init (after to_empty, on a single stage)."""
        for name, p in self.named_parameters():
            self.init_parameter(name, p.data)
        self.init_buffers()
        self._last_built = None
