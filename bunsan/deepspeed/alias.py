"""`bunsan.deepspeed.install()`: from here on, `import deepspeed` (and every `deepspeed.X`) is bunsan.deepspeed.

For programs whose DeepSpeed imports are not yours to edit: transformers' Trainer and accelerate (they import
`deepspeed` when `TrainingArguments(deepspeed=...)` is set, and check its installed version), or a package such
as DeepSpeed-Chat's `dschat` that imports it in every file. Call it before anything imports DeepSpeed:

    import bunsan.deepspeed
    bunsan.deepspeed.install()           # or: import bunsan.deepspeed.as_deepspeed
    from transformers import Trainer, TrainingArguments

The alias is an import hook, so `from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus` finds
bunsan's module, and `importlib.metadata.version("deepspeed")` answers the DeepSpeed release bunsan mirrors
(transformers and accelerate read it before they use DeepSpeed). A real DeepSpeed installed beside bunsan is
left on disk and not imported.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import sys
from pathlib import Path

__all__ = ["install", "installed"]

NAME = "deepspeed"
VERSION = "0.19.8"   # the DeepSpeed release whose API and meaning bunsan.deepspeed mirrors


class _Distribution(importlib.metadata.Distribution):
    """The package metadata of the alias: DeepSpeed's name, the version bunsan.deepspeed mirrors."""

    def read_text(self, filename: str) -> str | None:
        if filename == "METADATA":
            return (f"Metadata-Version: 2.1\nName: {NAME}\nVersion: {VERSION}\n"
                    "Summary: bunsan.deepspeed, installed as deepspeed by bunsan.deepspeed.install()\n")
        return None

    def locate_file(self, path) -> Path:
        return Path(__file__).parent / path


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path=None, target=None):
        if fullname != NAME and not fullname.startswith(NAME + "."):
            return None
        ours = importlib.util.find_spec("bunsan." + fullname)
        if ours is None:
            return None                  # not in DeepSpeed's API as bunsan knows it: the usual ImportError
        return importlib.machinery.ModuleSpec(fullname, self, is_package=ours.submodule_search_locations is not None)

    def create_module(self, spec):
        module = importlib.import_module("bunsan." + spec.name)   # one module object under both names
        module.__dict__.setdefault("_bunsan_spec", module.__spec__)
        return module

    def exec_module(self, module) -> None:
        # already executed as bunsan.deepspeed.X; the import system has just set its __spec__ to the alias's:
        # give it back its own, so that it stays bunsan's module under its own name
        module.__spec__ = module.__dict__.pop("_bunsan_spec")

    def find_distributions(self, context=importlib.metadata.DistributionFinder.Context()):
        if context.name in (None, NAME):
            yield _Distribution()


def installed() -> bool:
    return any(isinstance(f, _Alias) for f in sys.meta_path)


def install() -> None:
    """Make `import deepspeed` resolve to bunsan.deepspeed in this process (idempotent)."""
    if installed():
        return
    loaded = sys.modules.get(NAME)
    if loaded is not None and not getattr(loaded, "__name__", "").startswith("bunsan."):
        raise RuntimeError(f"bunsan.deepspeed.install(): DeepSpeed itself ({getattr(loaded, '__file__', '?')}) "
                           "was imported already, and its objects cannot be swapped afterwards; call install() "
                           "first, before transformers, accelerate or your own code import deepspeed")
    sys.meta_path.insert(0, _Alias())
