"""The ``--device`` flag as a torch device this machine has."""

from __future__ import annotations

import torch


def resolve_device(device: str) -> torch.device:
    """``auto``, ``cpu``, ``cuda`` or ``cuda:N`` as a device this machine has; a ``ValueError`` naming the flag
    otherwise (before any work, not at the first tensor moved)."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"--device {device!r}: expected auto, cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            why = "this torch build has no CUDA" if torch.version.cuda is None else "no CUDA GPU is visible"
            raise ValueError(f"--device {device}: CUDA is not available on this machine ({why}); use --device cpu")
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise ValueError(f"--device {device}: this machine has {count} CUDA device(s) (cuda:0 to cuda:{count - 1})")
    elif dev.type != "cpu":
        raise ValueError(f"--device {device!r}: expected auto, cpu, cuda or cuda:N")
    return dev
