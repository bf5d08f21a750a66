"""A safetensors file is untrusted input: its header is read and checked by bunsan before the library opens it.

The format: 8 bytes (little-endian u64 N), N bytes of JSON header {name: {dtype, shape, data_offsets}}, then
the data. What a damaged or crafted file can do if the header is taken on trust:

- a header length of 10 GiB (read whole before anything is checked) or offsets past the end of the file;
- a dtype changed with the bytes kept (F32 -> I32): every float read as an integer near 1e9, "loaded";
- a shape whose element count is not what its byte range holds.

`checked_header` answers each with an error naming the file, the tensor and the rule, reading at most the
header; `check_dtypes` is the loader's rule on top: weights are floating point (of the dtype expected, when
the loader knows it).
"""

from __future__ import annotations

import json
import math
import os
import stat
import struct
from pathlib import Path

# safetensors' dtypes and their sizes in bytes (the library's own names)
ITEM_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
              "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
FLOAT = ("F16", "BF16", "F32", "F64")
TORCH_NAME = {"F16": "float16", "BF16": "bfloat16", "F32": "float32", "F64": "float64", "U8": "uint8", "I16": "int16",
              "I8": "int8", "I32": "int32", "I64": "int64", "BOOL": "bool"}
MAX_HEADER = 100 * 1024 * 1024        # the safetensors library's own bound


class TensorFileError(ValueError):
    pass


def checked_header(path) -> dict[str, dict]:
    """{tensor name: {"dtype", "shape", "data_offsets"}} of a safetensors file whose header is consistent with
    its size: every byte range inside the data, of the size its dtype and shape say, no two overlapping."""
    path = Path(path)
    try:
        st = os.stat(path)
    except OSError as e:
        raise TensorFileError(f"{path} cannot be read: {e.strerror or type(e).__name__}") from None
    if not stat.S_ISREG(st.st_mode):
        raise TensorFileError(f"{path} is not a regular file; weights are read from safetensors files only")
    size = st.st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise TensorFileError(f"{path} holds {size} bytes, too few for a safetensors file (its 8-byte header "
                                  "length is missing); the file is truncated or not safetensors")
        n = struct.unpack("<Q", head)[0]
        if n > min(MAX_HEADER, size - 8):
            raise TensorFileError(f"{path}: the header length says {n:,} bytes, but the file holds {size:,} "
                                  f"(and a header may hold at most {MAX_HEADER:,}); the file is damaged or was "
                                  "made to exhaust memory")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError):
        raise TensorFileError(f"{path}: the header is not JSON; the file is damaged or not safetensors") from None
    if not isinstance(header, dict):
        raise TensorFileError(f"{path}: the header is a JSON {type(header).__name__}, not an object; damaged")
    data = size - 8 - n
    spans = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        spans.append(_check_entry(path, name, info, data))
    spans.sort()
    for (a0, a1, x), (b0, b1, y) in zip(spans, spans[1:]):
        if b0 < a1:
            raise TensorFileError(f"{path}: tensors {x!r} and {y!r} share bytes [{b0}, {min(a1, b1)}); the file "
                                  "is damaged or crafted")
    return {k: v for k, v in header.items() if k != "__metadata__"}


def _check_entry(path: Path, name: str, info, data: int) -> tuple[int, int, str]:
    if not isinstance(info, dict):
        raise TensorFileError(f"{path}: tensor {name[:80]!r} has no dtype/shape/offsets object; damaged")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if dtype not in ITEM_BYTES:
        raise TensorFileError(f"{path}: tensor {name[:80]!r} has dtype {str(dtype)[:20]!r}, not a safetensors "
                              "dtype; the file is damaged")
    if not (isinstance(shape, list) and all(_count(d) for d in shape)):
        raise TensorFileError(f"{path}: tensor {name[:80]!r} has shape {str(shape)[:60]}, not a list of "
                              "non-negative integers; the file is damaged")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_count(o) for o in offsets)
            and offsets[0] <= offsets[1] <= data):
        raise TensorFileError(f"{path}: tensor {name[:80]!r} has data offsets {str(offsets)[:60]} outside the "
                              f"{data:,} bytes of data the file holds; the file is truncated or damaged")
    want = math.prod(shape) * ITEM_BYTES[dtype]
    if offsets[1] - offsets[0] != want:
        raise TensorFileError(f"{path}: tensor {name[:80]!r} ({dtype} {shape}) needs {want:,} bytes, its "
                              f"offsets hold {offsets[1] - offsets[0]:,}; the file is damaged")
    return offsets[0], offsets[1], name


def _count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def check_dtypes(path, header: dict, expect: dict | None = None, what: str = "weight") -> None:
    """Every tensor floating point, and of the dtype `expect` names (tensor name -> torch dtype name such as
    "float32") where it names one: a weight stored as integers is refused, never converted."""
    for name, info in header.items():
        got = TORCH_NAME.get(info["dtype"], info["dtype"].lower())
        want = (expect or {}).get(name)
        if want is not None and got != want:
            raise TensorFileError(f"{path}: {what} {name!r} is stored as {got}, but was saved as {want}; the "
                                  "file was altered or mixed with another (refusing to reinterpret its bytes)")
        if want is None and info["dtype"] not in FLOAT:
            raise TensorFileError(f"{path}: {what} {name!r} is stored as {got}; weights are floating point "
                                  "(float32, bfloat16, float16): a quantised checkpoint (dequantise it first), or "
                                  "a file damaged or altered")
