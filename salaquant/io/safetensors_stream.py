"""Write a safetensors file tensor by tensor, without building the serialised file in memory first.

The format: an 8-byte little-endian header length, a JSON header (dtype, shape and byte range of each tensor
in the data section, padded with spaces to a multiple of 8 bytes), then the tensors' bytes in order. The
hidden states of a calibration run are several GiB; writing them straight from their (pinned) buffers keeps
the CPU peak at the buffers themselves, where a serialiser that returns ``bytes`` would add one more copy.
Tensors on an accelerator are copied to the CPU one at a time.
"""

from __future__ import annotations

import json
import struct
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import BinaryIO

import torch

from .atomic import naming

_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}


def _header(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None) -> bytes:
    entries: dict[str, object] = {}
    if metadata:
        entries["__metadata__"] = dict(metadata)
    offset = 0
    for name, t in tensors.items():
        if t.dtype not in _DTYPES:
            raise TypeError(f"tensor {name!r}: dtype {t.dtype} is not supported")
        nbytes = t.numel() * t.element_size()
        entries[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(entries, separators=(",", ":")).encode()
    return raw + b" " * (-len(raw) % 8)


def _write_tensor(f: BinaryIO, t: torch.Tensor) -> None:
    if t.device.type != "cpu":
        t = t.to("cpu")
    t = t.contiguous()
    if t.numel() == 0:
        return
    # Bytes of the storage as they are (little-endian hosts), whatever the element type.
    f.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))


def write_safetensors(
    tensors: Mapping[str, torch.Tensor], path: str | Path, metadata: Mapping[str, str] | None = None
) -> None:
    """Write ``tensors`` (in mapping order) to ``path`` as a safetensors file."""
    if sys.byteorder != "little":
        raise RuntimeError("safetensors stores little-endian data; this writer copies host bytes as they are")
    header = _header(tensors, metadata)
    with naming(Path(path)), open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)))
        f.write(header)
        for t in tensors.values():
            _write_tensor(f, t)
