"""`CheckpointReader`: a safetensors checkpoint folder opened lazily. Shard headers give names, shapes and dtypes
without touching tensor data (each header checked against its file: sizes, offsets, overlaps), tensors are read
one at a time through cached handles, and pickled weight files (``*.bin``, ``*.pt``, ``*.pth``) are refused."""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import struct
from collections.abc import Iterator, Sequence
from pathlib import Path, PurePosixPath
from typing import Any

import torch
from safetensors import safe_open

from .files import (
    CONFIG_NAME,
    INDEX_NAME,
    MAX_HEADER_BYTES,
    PICKLE_SUFFIXES,
    SINGLE_FILE_NAME,
    ST_DTYPES,
    CheckpointError,
    read_json_object,
)


class _TensorInfo:
    """Header entry of one tensor: dtype string, shape, byte size and where its bytes start in the file."""

    __slots__ = ("dtype", "nbytes", "offset", "shape")

    def __init__(self, dtype: str, shape: tuple[int, ...], nbytes: int, offset: int) -> None:
        self.dtype = dtype
        self.shape = shape
        self.nbytes = nbytes
        self.offset = offset


def _read_header(path: Path) -> dict[str, _TensorInfo]:
    """Parse the JSON header of a safetensors file without reading tensor data."""
    try:
        with path.open("rb") as f:
            raw_len = f.read(8)
            if len(raw_len) != 8:
                raise CheckpointError(f"{path}: file is too short to be a safetensors file")
            (header_len,) = struct.unpack("<Q", raw_len)
            if header_len > MAX_HEADER_BYTES:
                raise CheckpointError(f"{path}: safetensors header length {header_len} is not plausible")
            raw = f.read(header_len)
            file_size = os.fstat(f.fileno()).st_size
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read safetensors header: {exc}") from exc
    if len(raw) != header_len:
        raise CheckpointError(f"{path}: safetensors header is truncated")
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: safetensors header is not valid JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: safetensors header is not a JSON object")
    data_size = file_size - 8 - header_len
    infos: dict[str, _TensorInfo] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = str(entry["dtype"])
            shape = tuple(int(d) for d in entry["shape"])
            begin, end = (int(o) for o in entry["data_offsets"])
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{path}: malformed header entry for tensor {name!r}") from exc
        if not 0 <= begin <= end <= data_size:
            raise CheckpointError(
                f"{path}: tensor {name!r} data [{begin}, {end}) lies outside the file's "
                f"{data_size} data bytes (truncated file?)"
            )
        _check_size(path, name, dtype, shape, end - begin)
        infos[name] = _TensorInfo(dtype, shape, end - begin, 8 + header_len + begin)
    _check_layout(path, infos, 8 + header_len, data_size)
    return infos


def _check_size(path: Path, name: str, dtype: str, shape: tuple[int, ...], nbytes: int) -> None:
    """Refuse a tensor whose byte range does not hold exactly its shape's elements of its dtype (dtypes torch
    cannot represent are refused when the tensor is read)."""
    torch_dtype = ST_DTYPES.get(dtype)
    if torch_dtype is None:
        return
    need = torch_dtype.itemsize
    for d in shape:
        need *= d
    if any(d < 0 for d in shape) or need != nbytes:
        raise CheckpointError(
            f"{path}: tensor {name!r} of shape {list(shape)} and dtype {dtype} takes {need} bytes, but its "
            f"data_offsets span {nbytes}: the header is damaged"
        )


def _check_layout(path: Path, infos: dict[str, _TensorInfo], start: int, data_size: int) -> None:
    """Refuse byte ranges that are not what the safetensors format requires: taken in offset order, each tensor
    starts where the one before it ends and the last one ends at the end of the file. A header whose ranges
    overlap would read one tensor's bytes as another's; a gap or trailing bytes mean a damaged header or file.
    ``safe_open`` refuses such files only when a tensor is read; checking here lets ``inspect`` and every
    command's header checks see them."""
    end, last = 0, ""
    for name, info in sorted(infos.items(), key=lambda kv: (kv[1].offset, kv[1].nbytes)):
        begin = info.offset - start
        if begin < end:
            shared = f"[{begin}, {min(end, begin + info.nbytes)})"
            raise CheckpointError(
                f"{path}: tensors {last!r} and {name!r} share data bytes {shared}: the header is damaged"
            )
        if begin > end:
            between = f"between tensors {last!r} and {name!r}" if last else f"before tensor {name!r}"
            raise CheckpointError(
                f"{path}: data bytes [{end}, {begin}) {between} belong to no tensor: the header is damaged"
            )
        end, last = begin + info.nbytes, name
    if end != data_size:
        raise CheckpointError(
            f"{path}: the last {data_size - end} bytes of the file belong to no tensor (the data section holds "
            f"{data_size} bytes, the tensors {end}): the header is damaged or bytes were appended"
        )


def _check_shard_name(index_path: Path, shard: object) -> str:
    """Accept only plain relative shard paths inside the checkpoint folder."""
    if not isinstance(shard, str) or not shard:
        raise CheckpointError(f"{index_path}: weight_map holds a shard entry that is not a file name: {shard!r}")
    parts = PurePosixPath(shard.replace("\\", "/")).parts
    if PurePosixPath(shard).is_absolute() or Path(shard).is_absolute() or ".." in parts:
        raise CheckpointError(f"{index_path}: shard path {shard!r} points outside the checkpoint folder")
    return shard


class CheckpointReader:
    """Lazy reader for a Hugging Face safetensors checkpoint folder.

    The tensor map comes from ``model.safetensors.index.json`` when present, else from a single
    ``model.safetensors``, else from the headers of all ``*.safetensors`` files in the folder.
    Shapes and dtypes come from shard headers; tensor data is read only by `get` and friends,
    through ``safe_open`` handles that are opened on first use and cached per shard.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.exists():
            raise CheckpointError(f"checkpoint folder {self.path} does not exist")
        if not self.path.is_dir():
            raise CheckpointError(f"checkpoint path {self.path} is not a folder")
        self._weight_map: dict[str, str] = {}
        self._headers: dict[str, dict[str, _TensorInfo]] = {}
        self._handles: dict[str, Any] = {}
        self.index_path: Path | None = None
        self._locate_weights()
        config_path = self.path / CONFIG_NAME
        if not config_path.is_file():
            raise CheckpointError(f"checkpoint folder {self.path} has no {CONFIG_NAME}")
        self._config: dict[str, Any] | None = None

    # -- discovery ---------------------------------------------------------------------------

    def _locate_weights(self) -> None:
        index_path = self.path / INDEX_NAME
        single_path = self.path / SINGLE_FILE_NAME
        if index_path.is_file():
            self.index_path = index_path
            self._load_index(index_path)
            return
        if single_path.is_file():
            self._add_shard_from_header(SINGLE_FILE_NAME)
            return
        shards = sorted(p.name for p in self.path.glob("*.safetensors") if p.is_file())
        if shards:
            for shard in shards:
                self._add_shard_from_header(shard)
            return
        pickled = sorted(p.name for p in self.path.iterdir() if p.is_file() and p.suffix in PICKLE_SUFFIXES)
        if pickled:
            shown = ", ".join(pickled[:5]) + (", ..." if len(pickled) > 5 else "")
            raise CheckpointError(
                f"checkpoint folder {self.path} holds only pickled weights ({shown}); pickled "
                "checkpoints are never loaded because unpickling can run arbitrary code. Convert it "
                "to safetensors in a trusted environment, e.g. load it with transformers "
                "(AutoModelForCausalLM.from_pretrained(path)) and call "
                "model.save_pretrained(out_dir, safe_serialization=True), then point to out_dir"
            )
        raise CheckpointError(f"checkpoint folder {self.path} holds no *.safetensors weight files")

    def _load_index(self, index_path: Path) -> None:
        try:
            index = json.loads(index_path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"{index_path}: cannot parse index: {exc}") from exc
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index_path}: missing or empty 'weight_map'")
        present: set[str] = set()
        missing: dict[str, str] = {}
        for name, shard in weight_map.items():
            shard_name = _check_shard_name(index_path, shard)
            if shard_name not in present and shard_name not in missing:
                if (self.path / shard_name).is_file():
                    present.add(shard_name)
                else:
                    missing[shard_name] = str(name)
            self._weight_map[str(name)] = shard_name
        if missing:
            shard_name, tensor = next(iter(missing.items()))
            more = f" (and {len(missing) - 1} more missing shard(s))" if len(missing) > 1 else ""
            raise CheckpointError(
                f"{index_path}: shard file {shard_name!r} (holding e.g. tensor {tensor!r}) "
                f"does not exist in {self.path}{more}"
            )

    def _add_shard_from_header(self, shard: str) -> None:
        header = self._header(shard)
        for name in header:
            other = self._weight_map.get(name)
            if other is not None and other != shard:
                raise CheckpointError(f"tensor {name!r} appears in both {self.path / other} and {self.path / shard}")
            self._weight_map[name] = shard

    def _header(self, shard: str) -> dict[str, _TensorInfo]:
        header = self._headers.get(shard)
        if header is None:
            header = _read_header(self.path / shard)
            self._headers[shard] = header
        return header

    def _info(self, name: str) -> _TensorInfo:
        shard = self._shard_of(name)
        info = self._header(shard).get(name)
        if info is None:
            where = self.index_path if self.index_path is not None else self.path
            raise CheckpointError(
                f"{where}: tensor {name!r} is mapped to shard {shard!r}, but that shard's header does not list it"
            )
        return info

    def _shard_of(self, name: str) -> str:
        shard = self._weight_map.get(name)
        if shard is None:
            close = difflib.get_close_matches(name, self._weight_map.keys(), n=5, cutoff=0.6)
            hint = f"; close matches: {', '.join(close)}" if close else ""
            raise CheckpointError(f"tensor {name!r} is not in checkpoint {self.path}{hint}")
        return shard

    def _handle(self, shard: str) -> Any:
        handle = self._handles.get(shard)
        if handle is None:
            try:
                handle = safe_open(str(self.path / shard), framework="pt", device="cpu")
            except Exception as exc:
                raise CheckpointError(f"{self.path / shard}: cannot open safetensors file: {exc}") from exc
            self._handles[shard] = handle
        return handle

    # -- queries -----------------------------------------------------------------------------

    def keys(self) -> list[str]:
        """All tensor names, sorted."""
        return sorted(self._weight_map)

    def __contains__(self, name: object) -> bool:
        return name in self._weight_map

    def __len__(self) -> int:
        return len(self._weight_map)

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def shard_files(self) -> list[str]:
        """Shard file names (relative to the folder), sorted."""
        return sorted(set(self._weight_map.values()))

    def shard_of(self, name: str) -> str:
        """Shard file name holding tensor ``name``."""
        return self._shard_of(name)

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape of tensor ``name`` from the shard header."""
        return self._info(name).shape

    def dtype(self, name: str) -> torch.dtype:
        """Torch dtype of tensor ``name`` from the shard header."""
        st_dtype = self._info(name).dtype
        dtype = ST_DTYPES.get(st_dtype)
        if dtype is None:
            raise CheckpointError(f"tensor {name!r} has safetensors dtype {st_dtype!r}, which torch cannot represent")
        return dtype

    def offset(self, name: str) -> int:
        """Where tensor ``name``'s bytes start in its shard file."""
        return self._info(name).offset

    def nbytes(self, name: str) -> int:
        """Stored byte size of tensor ``name``."""
        return self._info(name).nbytes

    def total_bytes(self) -> int:
        """Sum of the stored byte sizes of all tensors (reads every shard header)."""
        return sum(self._info(name).nbytes for name in self._weight_map)

    def digest(self, name: str) -> str:
        """sha256 (hex) of tensor ``name``'s stored bytes, with its dtype and shape: what a resumed run compares
        to know the tensor is the one an earlier run read. Read straight from the file, in 16 MiB blocks."""
        info = self._info(name)
        h = hashlib.sha256(f"{info.dtype}:{list(info.shape)}:".encode())
        for block in self._byte_blocks(name, torch.empty(1 << 24, dtype=torch.uint8)):
            h.update(block.numpy())
        return h.hexdigest()

    def blocks(self, name: str, buffer: torch.Tensor) -> Iterator[torch.Tensor]:
        """Tensor ``name``'s values, flat and in order, in pieces read straight from the file into ``buffer`` (a
        uint8 tensor, reused for every piece): however large the tensor, memory stays at the buffer. Each piece
        is valid until the next one is read."""
        dtype = self.dtype(name)
        return (block.view(dtype) for block in self._byte_blocks(name, buffer, dtype.itemsize))

    def _byte_blocks(self, name: str, buffer: torch.Tensor, item: int = 1) -> Iterator[torch.Tensor]:
        """Tensor ``name``'s stored bytes in pieces of whole ``item``-byte elements, read into ``buffer``. While
        the caller works on a piece, the kernel is asked to read the next one (``POSIX_FADV_WILLNEED``), so the
        disk and the caller's work overlap."""
        info = self._info(name)
        path = self.path / self._shard_of(name)
        step = buffer.numel() // item * item
        view = memoryview(buffer.numpy())
        prefetch = getattr(os, "posix_fadvise", None)
        try:
            with path.open("rb") as f:
                f.seek(info.offset)
                left = info.nbytes
                while left:
                    size = min(left, step)
                    if f.readinto(view[:size]) != size:
                        raise CheckpointError(f"{path}: tensor {name!r} is cut short (truncated file?)")
                    if prefetch is not None:
                        prefetch(f.fileno(), f.tell(), step, os.POSIX_FADV_WILLNEED)
                    yield buffer[:size]
                    left -= size
        except OSError as exc:
            raise CheckpointError(f"{path}: cannot read tensor {name!r}: {exc}") from exc

    def config(self) -> dict[str, Any]:
        """Parsed ``config.json`` (cached; a copy is returned)."""
        if self._config is None:
            self._config = read_json_object(self.path / CONFIG_NAME)
        return json.loads(json.dumps(self._config))

    # -- loading -----------------------------------------------------------------------------

    def get(self, name: str, device: str | torch.device = "cpu", dtype: torch.dtype | None = None) -> torch.Tensor:
        """Load one tensor, optionally moving it to ``device`` and casting it to ``dtype``."""
        shard = self._shard_of(name)
        self._info(name)
        try:
            tensor = self._handle(shard).get_tensor(name)
        except CheckpointError:
            raise
        except Exception as exc:
            raise CheckpointError(f"{self.path / shard}: cannot read tensor {name!r}: {exc}") from exc
        if torch.device(device) != tensor.device:
            tensor = tensor.to(device)
        if dtype is not None and tensor.dtype != dtype:
            tensor = tensor.to(dtype)
        return tensor

    def get_checked(
        self,
        name: str,
        expected_shape: Sequence[int],
        device: str | torch.device = "cpu",
        dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """Load one tensor after checking its header shape against ``expected_shape``."""
        expected = tuple(int(d) for d in expected_shape)
        actual = self.shape(name)
        if actual != expected:
            raise CheckpointError(
                f"tensor {name!r} in {self.path / self._shard_of(name)} has shape {list(actual)}, "
                f"expected {list(expected)}"
            )
        return self.get(name, device=device, dtype=dtype)

    def close(self) -> None:
        """Drop the cached ``safe_open`` handles."""
        self._handles.clear()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"CheckpointReader({str(self.path)!r}, tensors={len(self)}, shards={len(self.shard_files())})"


# --------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------
