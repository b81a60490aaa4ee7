"""The streaming safetensors writer against the safetensors library's own reader."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from salaquant.io.safetensors_stream import write_safetensors


def test_round_trip_through_safetensors_reader(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    tensors = {
        "bf16": torch.randn(3, 5, 7, generator=g).to(torch.bfloat16),
        "f32": torch.randn(11, generator=g),
        "f64": torch.randn(2, 2, generator=g, dtype=torch.float64),
        "f16": torch.randn(4, 3, generator=g).half(),
        "i64": torch.randint(-(2**40), 2**40, (6,), generator=g),
        "i32": torch.randint(-100, 100, (2, 3), generator=g, dtype=torch.int32),
        "u8": torch.randint(0, 255, (9,), generator=g, dtype=torch.uint8),
        "i8": torch.randint(-128, 127, (5,), generator=g, dtype=torch.int8),
        "bool": torch.rand(7, generator=g) > 0.5,
        "f8e4m3": torch.randn(3, 4, generator=g).to(torch.float8_e4m3fn),
        "f8e5m2": torch.randn(5, generator=g).to(torch.float8_e5m2),
        "u32": torch.randint(0, 2**31, (3,), generator=g).to(torch.uint32),
        "empty": torch.zeros(0, 4),
        "scalar": torch.tensor(3.5),
        "strided": torch.randn(6, 8, generator=g).t(),  # non-contiguous view
    }
    path = tmp_path / "x.safetensors"
    write_safetensors(tensors, path, metadata={"format": "pt"})
    back = load_file(path)
    assert set(back) == set(tensors)
    for k, v in tensors.items():
        assert back[k].dtype == v.dtype and back[k].shape == v.shape, k
        assert torch.equal(back[k].reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8)), k  # bit-exact
    with safe_open(path, framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
    # Layout rules of the format: 8-byte length, header padded to a multiple of 8, data right after it.
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    assert n % 8 == 0
    header = json.loads(raw[8 : 8 + n])
    end = max(e["data_offsets"][1] for k, e in header.items() if k != "__metadata__")
    assert len(raw) == 8 + n + end


def test_rejects_unsupported_dtype(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="complex"):
        write_safetensors({"c": torch.zeros(2, dtype=torch.complex64)}, tmp_path / "c.safetensors")
