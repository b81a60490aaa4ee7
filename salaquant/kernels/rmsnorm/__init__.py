"""RMSNorm in one Triton kernel per call (the model's ``layers.rms_norm`` runs it on its Triton path).

A decode step normalises small tensors about 136 times (five norms per lightning layer, two per minicpm4 layer);
the PyTorch reference spends eight element-wise kernels on each, this one kernel.
"""

from __future__ import annotations

from .triton_kernels import rms_norm_triton

__all__ = ["rms_norm_triton"]
