"""What DeepSpeed has and bunsan does not, importable: a script that imports it still starts, and the name fails
where it is used (called, subclassed or read), saying what it is and what bunsan offers instead.

`ABSENT` lists DeepSpeed's modules that bunsan has no counterpart for; `import bunsan.deepspeed.ops.op_builder`
(or, after `install()`, `import deepspeed.ops.op_builder`) gives a module whose every name is such a stand-in.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

__all__ = ["Absent", "ABSENT"]

PREFIX = "bunsan.deepspeed."

# DeepSpeed module (under deepspeed.) -> what it is, for the error
ABSENT = {
    "ops.sparse_attention": "block-sparse attention kernels (DeepSpeed's Triton ops); bunsan's attention is "
                            "torch's scaled_dot_product_attention",
    "ops.op_builder": "C++/CUDA op builders (JIT-compiled kernels); bunsan builds no native ops",
    "ops.transformer": "fused transformer-layer kernels; build the model from plain torch layers",
    "ops.aio": "the async NVMe I/O library; bunsan's NVMe offload uses positional reads and writes",
    "ops.lion": "Lion; use AdamW",
    "ops.lamb": "FusedLamb as an object; set optimizer.type 'Lamb' in the config",
    "module_inject": "kernel injection for inference; use bunsan.deepspeed.init_inference (plain modules, TP)",
    "inference.v2": "DeepSpeed-FastGen's ragged inference engine; serve with `bunsan serve`",
    "runtime.domino": "Domino's overlapped tensor parallelism; set tensor_parallel.size in the config",
    "runtime.data_pipeline.data_routing": "random layer-token drop (random-LTD)",
    "runtime.data_pipeline.data_sampling": "data-efficiency sampling by difficulty metrics (offline analysis)",
    "compression.compress": "the compression library (quantization, pruning, layer reduction)",
    "compression.basic_layer": "the compression library's layers",
    "sequence": "Ulysses sequence parallelism; set context_parallel.size in the config",
    "autotuning": "the autotuner; rank layouts with `bunsan plan`",
    "elasticity": "elastic training",
    "profiling": "the FLOPs profiler; bunsan's metric records hold tokens/s and MFU",
    "monitor": "the W&B / CSV / Comet monitors; `bunsan train` writes metrics.jsonl and TensorBoard scalars",
}
# names at DeepSpeed's top level that bunsan does not have -> what they are
TOP_LEVEL = {
    "DeepSpeedTransformerLayer": ABSENT["ops.transformer"], "DeepSpeedTransformerConfig": ABSENT["ops.transformer"],
    "replace_transformer_layer": ABSENT["module_inject"], "revert_transformer_layer": ABSENT["module_inject"],
    "module_inject": ABSENT["module_inject"],
    "DeepSpeedConfig": "config object; bunsan reads the same dict or file with bunsan.Config.load(config)",
}


class Absent:
    """Stands for DeepSpeed's `qualname`; any use raises, naming it and what it is."""

    def __init__(self, qualname: str, why: str):
        self._qualname, self._why = qualname, why

    def _refuse(self, *args, **kwargs):
        raise NotImplementedError(f"{self._qualname} is DeepSpeed's {self._why}: bunsan does not have it. "
                                  "Remove the use, or run this script with DeepSpeed itself")

    __call__ = _refuse

    def __mro_entries__(self, bases):
        self._refuse()

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return Absent(f"{self._qualname}.{name}", self._why)

    def __bool__(self) -> bool:
        self._refuse()

    def __repr__(self) -> str:
        return f"<absent in bunsan: {self._qualname}>"


def _why(dotted: str) -> str | None:
    """The reason for the absent module `dotted` (under deepspeed.), or None when bunsan has it."""
    for name, why in ABSENT.items():
        if dotted == name or dotted.startswith(name + "."):
            return why
    return None


class _AbsentModule(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return Absent(f"deepspeed.{self.__name__[len(PREFIX):]}.{name}", self.__dict__["_why"])


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Makes `bunsan.deepspeed.<absent module>` importable (a package of stand-ins)."""

    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith(PREFIX) or _why(fullname[len(PREFIX):]) is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec):
        module = _AbsentModule(spec.name)
        module._why = _why(spec.name[len(PREFIX):])
        return module

    def exec_module(self, module) -> None:
        module.__path__ = []


def install_finder() -> None:
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.append(_Finder())   # after the real finders: a module bunsan has always wins
