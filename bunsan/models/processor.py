"""A model folder's processor (transformers' AutoProcessor), also where transformers cannot build its video processor.

transformers 5 builds every sub-processor a processor class names, and a video processor needs torchvision
(Qwen2-VL's, Qwen2.5-VL's, ...): without torchvision AutoProcessor fails for the images as well, though bunsan
reads no video (bunsan train refuses video parts, bunsan serve takes images). Then the folder's processor class is
loaded without its video processor, everything else as AutoProcessor loads it (the tokenizer; the image processor,
PIL's where torchvision's is missing, as transformers falls back itself). Videos handed to that processor are an
error naming the cause, never dropped; it pickles by loading the folder again (data.tokenize_workers' processes).
"""

from __future__ import annotations

import inspect
import logging
import os
from pathlib import Path

from bunsan.models.model_dir import read_json

log = logging.getLogger("bunsan")

# where a saved processor names its class, in the order AutoProcessor reads them (then config.json's model_type)
CLASS_FILES = ("processor_config.json", "preprocessor_config.json", "video_preprocessor_config.json",
               "tokenizer_config.json")
_WITHOUT_VIDEO: dict[type, type] = {}


def load_processor(folder):
    """AutoProcessor.from_pretrained(folder) from local files; where that fails on a missing backend (an
    ImportError: torchvision for the video processor), the processor without its video processor."""
    from transformers import AutoProcessor
    try:
        return AutoProcessor.from_pretrained(str(folder), local_files_only=True)
    except ImportError as e:
        missing = e
    cls = processor_class(folder)
    if cls is None or not any("video" in a for a in _attributes(cls)):
        raise missing
    try:
        processor = without_video(cls).from_pretrained(str(folder), local_files_only=True)
    except Exception as e:      # noqa: BLE001  (then the image processor or tokenizer cannot load either)
        raise ImportError(f"{str(missing).strip()} (and {cls.__name__} without its video processor cannot load "
                          f"either: {type(e).__name__}: {str(e).strip()[:300]})") from None
    processor._bunsan_folder = str(folder)
    log.info("%s: %s loaded without its video processor (%s); images and audio are read, videos are not",
             folder, cls.__name__, str(missing).strip().splitlines()[0])
    return processor


def processor_class(folder) -> type | None:
    """The processor class a saved folder names (processor_class in its configs, else its model type's)."""
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES, processor_class_from_name
    folder = Path(folder)
    name = next((n for f in CLASS_FILES if (n := _read(folder / f).get("processor_class"))), None)
    name = name or PROCESSOR_MAPPING_NAMES.get(_read(folder / "config.json").get("model_type"))
    return processor_class_from_name(name) if isinstance(name, str) else None


def without_video(cls: type) -> type:
    """`cls` (a ProcessorMixin) with its video sub-processors left out of the ones it loads and checks; the same
    name, so messages and saved configs say the model's own processor."""
    if cls not in _WITHOUT_VIDEO:
        kept = [a for a in _attributes(cls) if "video" not in a]
        signature = inspect.signature(cls.__call__)

        def __call__(self, *args, **kwargs):
            try:
                videos = signature.bind(self, *args, **kwargs).arguments.get("videos")
            except TypeError:
                videos = kwargs.get("videos")
            if videos is not None:
                raise ValueError(f"{cls.__name__} was loaded without its video processor (transformers builds it "
                                 "with torchvision, which is not installed), so it reads no videos; install "
                                 "torchvision to process videos")
            return cls.__call__(self, *args, **kwargs)

        _WITHOUT_VIDEO[cls] = type(cls.__name__, (cls,), {
            "__module__": __name__, "__qualname__": cls.__name__, "__call__": __call__,
            "__reduce__": lambda self: (load_processor, (self._bunsan_folder,)),
            "get_attributes": classmethod(lambda _: list(kept)),     # transformers 5
            "attributes": list(kept)})                                  # transformers 4
    return _WITHOUT_VIDEO[cls]


def _attributes(cls: type) -> list[str]:
    return list(cls.get_attributes() if hasattr(cls, "get_attributes") else getattr(cls, "attributes", []))


def _read(path: Path) -> dict:
    """A config of the folder ({} without it); one that is not a JSON object is refused naming it (model_dir.py)."""
    return read_json(path) if os.path.lexists(path) else {}
