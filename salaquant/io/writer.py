"""`CheckpointWriter`: a sharded safetensors checkpoint written into a staging folder beside its destination and
moved into place only when complete (or left staged for a check first); `save_state_dict` for a whole state."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from fnmatch import fnmatch
from pathlib import Path, PurePosixPath
from typing import Any, cast

import torch
from safetensors.torch import save as _st_save

from .atomic import naming
from .files import (
    CONFIG_NAME,
    DEFAULT_MAX_SHARD_BYTES,
    INDEX_NAME,
    SERVING_FILES,
    SHARD_NAME,
    SINGLE_FILE_NAME,
    WEIGHT_INDEX_SUFFIXES,
    WEIGHT_SUFFIXES,
    CheckpointError,
)
from .safetensors_stream import write_safetensors
from .staging import replace_folder, staging_folder

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
    if name.endswith(WEIGHT_INDEX_SUFFIXES):
        return True
    return name.endswith(WEIGHT_SUFFIXES)


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
            if not self.overwrite and any(out.iterdir()):
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

    def __exit__(self, exc_type: type[BaseException] | None, *exc_info: object) -> None:
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
