"""The files of a Hugging Face model folder as salaquant reads and writes them: their names, which of them are
weights (never loaded when pickled), which serving files an export copies from its source, the safetensors dtype
names, and `CheckpointError` for a folder that breaks them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

CONFIG_NAME = "config.json"
INDEX_NAME = "model.safetensors.index.json"
SINGLE_FILE_NAME = "model.safetensors"
SHARD_NAME = "model-{index:05d}-of-{count:05d}.safetensors"  # each shard, when there are several
# How salaquant made a checkpoint (an export's settings, a random checkpoint's seed): the file that marks a folder
# as salaquant's own, which `--overwrite` may replace (salaquant.ownership).
SETTINGS_NAME = "salaquant_settings.json"
DEFAULT_MAX_SHARD_BYTES = 4 * 10**9

PICKLE_SUFFIXES = (".bin", ".pt", ".pth")
# Files never copied by `CheckpointWriter.copy_aux`: weights in any format and their indexes.
WEIGHT_SUFFIXES = (
    ".safetensors",
    ".bin",
    ".pt",
    ".pth",
    ".ckpt",
    ".pkl",
    ".pickle",
    ".h5",
    ".msgpack",
    ".gguf",
    ".onnx",
)
# What `CheckpointWriter.copy_aux` copies from a source folder (lower-case shell patterns of top-level names).
SERVING_FILES = (
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.*",
    "merges.txt",
    "*.model",
    "*.tiktoken",
    "chat_template*",
    "*.jinja",
    "generation_config.json",
    "*.py",
    "readme*",
    "license*",
    "licence*",
    "notice*",
    "use_policy*",
)
WEIGHT_INDEX_SUFFIXES = (".safetensors.index.json", ".bin.index.json")
MAX_HEADER_BYTES = 100 * 1024 * 1024

ST_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "C64": torch.complex64,
}
for _st_name, _torch_name in (
    ("U16", "uint16"),
    ("U32", "uint32"),
    ("U64", "uint64"),
    ("F8_E4M3FNUZ", "float8_e4m3fnuz"),
    ("F8_E5M2FNUZ", "float8_e5m2fnuz"),
    ("F8_E8M0", "float8_e8m0fnu"),
):
    if hasattr(torch, _torch_name):
        ST_DTYPES[_st_name] = getattr(torch, _torch_name)


class CheckpointError(ValueError):
    """A checkpoint folder, file or tensor cannot be read or written as asked."""


def read_json_object(path: Path) -> dict[str, Any]:
    """The JSON object in ``path`` (a config or tokenizer file of a checkpoint); `CheckpointError` naming the file
    when it cannot be read, is not UTF-8 JSON or holds something other than an object."""
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: cannot parse: {exc}") from exc
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path}: top level is not a JSON object")
    return obj


# --------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------
