"""A work folder's resume state (``state.json``): what the run was computed from (the fingerprinted inputs and the
content digest of every tensor its finished layers read) and how many layers are done. A resumed run continues
only from a folder written with the same inputs from the same bytes, and says which differ when they do not."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

from ..io.atomic import atomic_json
from ..io.reader import CheckpointReader
from ..work_folder import ResumeError
from .distributed import Ranks, broadcast_object
from .fingerprint import differences

log = logging.getLogger("salaquant.calibration.engine")

__all__ = ["ResumeState"]


class ResumeState:
    """``state.json`` in ``work_dir`` for a run of ``num_layers`` layers with the fingerprinted ``inputs`` (model,
    data, engine options, statistics tree, settings, version), reading tensors from ``reader``."""

    def __init__(
        self,
        work_dir: Path,
        reader: CheckpointReader,
        inputs: dict[str, Any],
        num_layers: int,
        resume_every: int,
    ) -> None:
        self.work_dir, self.reader, self.num_layers, self.resume_every = work_dir, reader, num_layers, resume_every
        self.inputs: dict[str, Any] = json.loads(json.dumps(inputs, default=str))
        self.settings = self.inputs.get("settings", {})
        self.fingerprint = hashlib.sha256(json.dumps(self.inputs, sort_keys=True).encode()).hexdigest()
        self._digests: dict[str, str] = {}  # tensor -> digest of what this run (and the runs it resumes) read

    @property
    def path(self) -> Path:
        return self.work_dir / "state.json"

    def resume_point(self, resume: bool, ranks: Ranks) -> int:
        """`read` on rank 0 (the content check reads the whole checkpoint once), its answer or its refusal on every
        process."""
        answer: tuple[int, str | None] = (0, None)
        if ranks.main:
            try:
                answer = (self.read(resume), None)
            except ResumeError as exc:
                answer = (0, str(exc))
        finished, refusal = broadcast_object(answer, ranks)
        if refusal is not None:
            raise ResumeError(refusal)
        return finished

    def read(self, resume: bool) -> int:
        """Number of finished layers in the work folder (0 for a fresh run). A resumed run first checks that the
        checkpoint still holds, byte for byte, every tensor the finished layers were computed from."""
        if not self.path.exists():
            return 0
        state = json.loads(self.path.read_text())
        if not resume:
            raise ResumeError(
                f"{self.work_dir} holds an unfinished run ({state.get('finished', 0)} of "
                f"{state.get('num_layers')} layers done): rerun with --resume to continue it, or with --overwrite to "
                "discard it and start over"
            )
        if state.get("fingerprint") != self.fingerprint:
            raise ResumeError(
                f"{self.work_dir} does not match this run (fingerprint mismatch): it was written with "
                f"{differences(state.get('inputs'), self.inputs)}; to continue it, rerun with what it was written "
                "with; to discard it and start over, rerun with --overwrite instead of --resume"
            )
        digests: dict[str, str] = state.get("tensors", {})
        log.info("resume: checking the content of %d tensors read by the finished layers", len(digests))
        for name, digest in digests.items():
            if name not in self.reader or self.reader.digest(name) != digest:
                raise ResumeError(
                    f"{self.work_dir} was computed from a different checkpoint: tensor {name} in "
                    f"{self.reader.path} is not the one the finished layers read (content fingerprint mismatch): "
                    "to continue it, rerun with the checkpoint it was computed from; to discard it and start over, "
                    "rerun with --overwrite instead of --resume"
                )
        self.reader.close()
        self._digests = dict(digests)
        return int(state["finished"])

    def record_digests(self, prefix: str) -> None:
        """Digests of the tensors whose names start with ``prefix`` (read from the page cache: just loaded)."""
        for name in self.reader:
            if name.startswith(prefix) and name not in self._digests:
                self._digests[name] = self.reader.digest(name)

    def write(self, finished: int) -> None:
        atomic_json(
            {
                "fingerprint": self.fingerprint,
                "inputs": self.inputs,
                "finished": finished,
                "num_layers": self.num_layers,
                "resume_every": self.resume_every,
                "settings": self.settings,
                "tensors": self._digests,
            },
            self.path,
        )
