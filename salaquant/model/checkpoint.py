"""Safetensors checkpoint reading and writing for Hugging Face model folders.

`CheckpointReader` opens a checkpoint folder lazily: shard headers give names, shapes and
dtypes without touching tensor data, and tensors are read one at a time. `CheckpointWriter`
writes a sharded checkpoint into a temporary sibling folder and moves it into place only when
everything has been written. Pickled weight files (``*.bin``, ``*.pt``, ``*.pth``) are never
loaded.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import shutil
import struct
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from fnmatch import fnmatch
from pathlib import Path, PurePosixPath
from types import TracebackType
from typing import Any, cast

import torch
from safetensors import safe_open
from safetensors.torch import save as _st_save

from ..atomic import naming
from ..safetensors_stream import write_safetensors

__all__ = [
    "CONFIG_NAME",
    "DEFAULT_MAX_SHARD_BYTES",
    "INDEX_NAME",
    "SERVING_FILES",
    "SETTINGS_NAME",
    "SHARD_NAME",
    "SINGLE_FILE_NAME",
    "CheckpointError",
    "CheckpointReader",
    "CheckpointWriter",
    "backup_name",
    "read_json_object",
    "remove_stale_staging",
    "replace_folder",
    "save_state_dict",
    "staging_folder",
    "staging_name",
]

CONFIG_NAME = "config.json"
INDEX_NAME = "model.safetensors.index.json"
SINGLE_FILE_NAME = "model.safetensors"
SHARD_NAME = "model-{index:05d}-of-{count:05d}.safetensors"  # each shard, when there are several
# How salaquant made a checkpoint (an export's settings, a random checkpoint's seed): the file that marks a folder
# as salaquant's own, which `--overwrite` may replace (salaquant.ownership).
SETTINGS_NAME = "salaquant_settings.json"
DEFAULT_MAX_SHARD_BYTES = 4 * 10**9

_PICKLE_SUFFIXES = (".bin", ".pt", ".pth")
# Files never copied by `CheckpointWriter.copy_aux`: weights in any format and their indexes.
_WEIGHT_SUFFIXES = (
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
_WEIGHT_INDEX_SUFFIXES = (".safetensors.index.json", ".bin.index.json")
_MAX_HEADER_BYTES = 100 * 1024 * 1024

_ST_DTYPES: dict[str, torch.dtype] = {
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
        _ST_DTYPES[_st_name] = getattr(torch, _torch_name)


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
            if header_len > _MAX_HEADER_BYTES:
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
    torch_dtype = _ST_DTYPES.get(dtype)
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
        pickled = sorted(p.name for p in self.path.iterdir() if p.is_file() and p.suffix in _PICKLE_SUFFIXES)
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
        dtype = _ST_DTYPES.get(st_dtype)
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

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"CheckpointReader({str(self.path)!r}, tensors={len(self)}, shards={len(self.shard_files())})"


# --------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------

_dtype_support: dict[torch.dtype, bool] = {}


def _safetensors_supports(dtype: torch.dtype) -> bool:
    supported = _dtype_support.get(dtype)
    if supported is None:
        try:
            _st_save({"x": torch.empty(0, dtype=dtype)})
            supported = True
        except Exception:
            supported = False
        _dtype_support[dtype] = supported
    return supported


def _is_weight_file(rel: PurePosixPath) -> bool:
    name = rel.name.lower()
    if name.endswith(_WEIGHT_INDEX_SUFFIXES):
        return True
    return name.endswith(_WEIGHT_SUFFIXES)


def _dir_is_nonempty(path: Path) -> bool:
    return any(path.iterdir())


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_staging(out_dir: Path) -> list[Path]:
    """Remove the temporary folders that killed writers of ``out_dir`` left beside it (``.NAME.tmp-PID-*`` whose
    process is gone); returns what was removed."""
    removed = []
    parent = out_dir.parent
    if not parent.is_dir():
        return removed
    prefix = f".{out_dir.name}.tmp-"
    for entry in parent.iterdir():
        if not entry.name.startswith(prefix) or not entry.is_dir():
            continue
        pid = entry.name[len(prefix) :].split("-", 1)[0]
        if pid.isdigit() and not _pid_alive(int(pid)):
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed


_PID_DIGITS = 7  # Linux process ids are below 2**22 (pid_max at most 4194304)
_RANDOM_CHARS = 8  # what tempfile.mkdtemp adds to its prefix


_WIDEST_TAIL = f"{'P' * _PID_DIGITS}-{'X' * _RANDOM_CHARS}"


def staging_name(out_dir: Path) -> str:
    """The longest name `staging_folder` gives the folder it makes beside ``out_dir``."""
    return f".{out_dir.name}.tmp-{_WIDEST_TAIL}"


def backup_name(out_dir: Path) -> str:
    """The longest name `replace_folder` gives the backup of an existing ``out_dir`` it replaces."""
    return f".{out_dir.name}.old-{_WIDEST_TAIL}"


def staging_folder(out_dir: Path) -> Path:
    """A new temporary folder beside ``out_dir`` (``.NAME.tmp-PID-*``), with the permissions of a folder made by
    ``mkdir`` under the current umask (``mkdtemp`` alone gives 0700: a server running as another user could not
    read the export). Leftovers of killed writers of the same output are removed first."""
    parent = out_dir.parent
    parent.mkdir(parents=True, exist_ok=True)
    remove_stale_staging(out_dir)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-{os.getpid()}-", dir=parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)
    return tmp


def replace_folder(tmp: Path, out_dir: Path) -> None:
    """Rename the complete folder ``tmp`` to ``out_dir``; an existing ``out_dir`` is removed only once the new one
    is in place (it is restored if the rename fails). Every output salaquant replaces goes through here, so here,
    at the moment of replacing, an ``out_dir`` holding files salaquant did not write is refused
    (`salaquant.outputs.refuse_foreign`: a file a user put there during a long run is caught too)."""
    if out_dir.exists() or out_dir.is_symlink():
        from ..outputs import refuse_foreign

        refuse_foreign(out_dir)
        backup = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-{os.getpid()}-", dir=out_dir.parent))
        backup.rmdir()
        os.replace(out_dir, backup)
        try:
            os.replace(tmp, out_dir)
        except BaseException:
            os.replace(backup, out_dir)
            raise
        shutil.rmtree(backup, ignore_errors=True)
    else:
        os.replace(tmp, out_dir)


class CheckpointWriter:
    """Write a sharded safetensors checkpoint atomically.

    Use as a context manager. Everything is written into a temporary folder next to ``out_dir``;
    on a clean exit the shards are given their final names, the index is written (multi-shard
    only) and the folder is renamed to ``out_dir``. On an exception the temporary folder is removed
    and any previous ``out_dir`` is left untouched. An existing non-empty ``out_dir`` is refused
    unless ``overwrite`` is set, in which case it is removed only after the new folder is complete;
    a folder holding files salaquant did not write (`salaquant.ownership`) is refused even then
    (`salaquant.outputs.OutputError`), when the writer is made and again before it is replaced.

    With ``place=False`` a clean exit leaves the complete folder at `staged`, beside ``out_dir``, for the caller to
    check there; `move_into_place` then moves it (and `discard` removes it), so that a folder failing a check
    never stands at ``out_dir``.
    """

    def __init__(
        self,
        out_dir: str | Path,
        max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
        overwrite: bool = False,
        place: bool = True,
    ) -> None:
        if max_shard_bytes <= 0:
            raise CheckpointError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
        self.out_dir = Path(out_dir)
        self.max_shard_bytes = int(max_shard_bytes)
        self.overwrite = overwrite
        self.place = place
        self._check_target()
        self._tmp: Path | None = None
        self._staged: Path | None = None  # complete, not yet placed (place=False)
        self._closed = False
        self._buffer: dict[str, torch.Tensor] = {}
        self._buffer_bytes = 0
        self._shards: list[tuple[str, list[str]]] = []  # (temporary file name, tensor names)
        self._sizes: dict[str, int] = {}
        self._extra_files: set[str] = set()

    def _check_target(self) -> None:
        out = self.out_dir
        if out.exists() or out.is_symlink():
            if not out.is_dir() or out.is_symlink():
                raise CheckpointError(f"output path {out} exists and is not a plain folder (file or symlink)")
            if not self.overwrite and _dir_is_nonempty(out):
                raise CheckpointError(f"output folder {out} exists and is not empty; pass overwrite=True to replace it")
            from ..outputs import refuse_foreign

            refuse_foreign(out)

    @property
    def tmp_dir(self) -> Path:
        """Temporary folder being written (only inside the ``with`` block)."""
        self._require_open()
        return cast(Path, self._tmp)

    def _require_open(self) -> None:
        if self._tmp is None or self._closed:
            raise CheckpointError(f"CheckpointWriter for {self.out_dir} is not open; use it as a context manager")

    def __enter__(self) -> CheckpointWriter:
        if self._tmp is not None:
            raise CheckpointError(f"CheckpointWriter for {self.out_dir} cannot be entered twice")
        self._check_target()
        self._tmp = staging_folder(self.out_dir)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is not None:
            self.abort()
            return
        try:
            self._finish()
        except BaseException:
            self.abort()
            raise

    # -- tensors -----------------------------------------------------------------------------

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Queue one tensor; a shard is written when the buffer would exceed ``max_shard_bytes``.

        The tensor is copied to contiguous CPU memory, so later in-place changes by the caller do
        not affect what is written.
        """
        self._require_open()
        if not isinstance(name, str) or not name:
            raise CheckpointError(f"tensor name must be a non-empty string, got {name!r}")
        if not isinstance(tensor, torch.Tensor):
            raise CheckpointError(f"tensor {name!r}: expected a torch.Tensor, got {type(tensor).__name__}")
        if name in self._sizes:
            raise CheckpointError(f"tensor {name!r} was already added to {self.out_dir}")
        if not _safetensors_supports(tensor.dtype):
            raise CheckpointError(f"tensor {name!r}: dtype {tensor.dtype} cannot be stored in safetensors")
        src = tensor.detach()
        cpu = src.to("cpu").contiguous()
        if cpu.untyped_storage().data_ptr() == src.untyped_storage().data_ptr() and cpu.device == src.device:
            cpu = cpu.clone()
        nbytes = cpu.numel() * cpu.element_size()
        if self._buffer and self._buffer_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        self._buffer[name] = cpu
        self._buffer_bytes += nbytes
        self._sizes[name] = nbytes

    def add_many(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """`add` every item of ``tensors`` in iteration order."""
        for name, tensor in tensors.items():
            self.add(name, tensor)

    def _flush(self) -> None:
        if not self._buffer:
            return
        tmp_name = f"shard-{len(self._shards) + 1:05d}.safetensors.part"
        path = self.tmp_dir / tmp_name
        try:
            write_safetensors(self._buffer, path, metadata={"format": "pt"})  # streamed: no serialized copy
        except Exception as exc:
            raise CheckpointError(f"{path}: cannot write shard with tensors {sorted(self._buffer)[:5]}: {exc}") from exc
        self._shards.append((tmp_name, list(self._buffer)))
        self._buffer = {}
        self._buffer_bytes = 0

    # -- auxiliary files ---------------------------------------------------------------------

    def _aux_target(self, name: str | PurePosixPath) -> PurePosixPath:
        rel = PurePosixPath(str(name).replace("\\", "/"))
        if rel.is_absolute() or not rel.parts or any(p in ("", ".", "..") for p in rel.parts):
            raise CheckpointError(f"file name {str(name)!r} must be a relative path inside {self.out_dir}")
        lowered = rel.name.lower()
        if len(rel.parts) == 1 and (lowered == INDEX_NAME or lowered.endswith(".safetensors")):
            raise CheckpointError(f"file name {str(name)!r} is reserved for weights written by CheckpointWriter")
        return rel

    def write_json(self, name: str, obj: Any) -> Path:
        """Write ``obj`` as JSON (indent 2, key order kept) to ``name`` inside the output folder."""
        try:
            text = json.dumps(obj, indent=2, sort_keys=False, ensure_ascii=False)
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"{name}: object is not JSON serialisable: {exc}") from exc
        return self.write_text(name, text + "\n")

    def write_text(self, name: str, text: str) -> Path:
        """Write ``text`` (UTF-8) to ``name`` inside the output folder; a failed write names the file."""
        rel = self._aux_target(name)
        path = self.tmp_dir.joinpath(*rel.parts)
        with naming(path):
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
        self._extra_files.add(rel.as_posix())
        return self.out_dir.joinpath(*rel.parts)

    def copy_aux(self, src_dir: str | Path) -> list[str]:
        """Copy the files of checkpoint folder ``src_dir`` that a serving engine and a model card need.

        Top-level files matching `SERVING_FILES` (tokenizer and template files, generation config, remote-code
        ``*.py``, README and licence files); weights, weight indexes, ``config.json``, hidden files and
        anything else (held-out data, training logs, earlier reports) stay behind. Files are only copied, never
        imported or run. Files already written with `write_json` are not replaced. Returns the copied names,
        sorted.
        """
        src = Path(src_dir)
        if not src.is_dir():
            raise CheckpointError(f"auxiliary source folder {src} does not exist or is not a folder")
        copied: list[str] = []
        for entry in sorted(src.iterdir(), key=lambda p: p.name):
            name = entry.name
            if name.startswith(".") or not entry.is_file() or name == CONFIG_NAME or name in self._extra_files:
                continue
            if _is_weight_file(PurePosixPath(name)) or not any(fnmatch(name.lower(), p) for p in SERVING_FILES):
                continue
            try:
                shutil.copyfile(entry, self.tmp_dir / name)
            except OSError as exc:
                raise CheckpointError(f"cannot copy {entry} to the output: {exc}") from exc
            copied.append(name)
        return copied

    # -- finishing ---------------------------------------------------------------------------

    def _finish(self) -> None:
        tmp = self.tmp_dir
        self._flush()
        if not self._shards:
            raise CheckpointError(f"no tensors were added to the checkpoint for {self.out_dir}")
        if len(self._shards) == 1:
            tmp_name, _ = self._shards[0]
            os.replace(tmp / tmp_name, tmp / SINGLE_FILE_NAME)
        else:
            count = len(self._shards)
            weight_map: dict[str, str] = {}
            for i, (tmp_name, names) in enumerate(self._shards, start=1):
                final = SHARD_NAME.format(index=i, count=count)
                os.replace(tmp / tmp_name, tmp / final)
                for name in names:
                    weight_map[name] = final
            index = {
                "metadata": {"total_size": sum(self._sizes.values())},
                "weight_map": {name: weight_map[name] for name in sorted(weight_map)},
            }
            with naming(tmp / INDEX_NAME):
                (tmp / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
        if self.place:
            self._move_into_place(tmp)
        else:
            self._staged = tmp
        self._closed = True

    @property
    def staged(self) -> Path:
        """The complete folder a ``place=False`` writer left beside ``out_dir`` (until `move_into_place`)."""
        if self._staged is None:
            raise CheckpointError(f"CheckpointWriter for {self.out_dir} holds no complete folder to place")
        return self._staged

    def move_into_place(self) -> None:
        """Move the `staged` folder to ``out_dir``."""
        staged = self.staged
        self._move_into_place(staged)
        self._staged = None

    def discard(self) -> None:
        """Remove the `staged` folder (when there is one)."""
        if self._staged is not None:
            shutil.rmtree(self._staged, ignore_errors=True)
            self._staged = None

    def _move_into_place(self, tmp: Path) -> None:
        if self.out_dir.exists() or self.out_dir.is_symlink():
            self._check_target()  # the folder may have appeared after the writer was created
        replace_folder(tmp, self.out_dir)

    def abort(self) -> None:
        """Discard everything written so far; the output folder is not touched."""
        if self._tmp is not None and not self._closed:
            shutil.rmtree(self._tmp, ignore_errors=True)
        self._buffer = {}
        self._buffer_bytes = 0
        self._closed = True

    @property
    def total_bytes(self) -> int:
        """Sum of the byte sizes of all tensors added so far."""
        return sum(self._sizes.values())


def save_state_dict(
    state: Mapping[str, torch.Tensor],
    out_dir: str | Path,
    config: Mapping[str, Any],
    *,
    aux_from: str | Path | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
) -> Path:
    """Write ``state`` and ``config.json`` (plus auxiliary files of ``aux_from``) to ``out_dir``."""
    with CheckpointWriter(out_dir, max_shard_bytes=max_shard_bytes, overwrite=overwrite) as writer:
        writer.write_json(CONFIG_NAME, dict(config))
        if aux_from is not None:
            writer.copy_aux(aux_from)
        writer.add_many(state)
    return Path(out_dir)
