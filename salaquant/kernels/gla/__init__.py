"""Simple GLA (Lightning attention) in Triton: chunked prefill (``chunk_fwd``) and fused recurrent decode
(``recurrent_fwd``), both in ``triton_kernels``.

The math, the layout and the choice between the two forms are the reference's (the model package's ``gla.py``), whose
``simple_gla(..., backend=...)`` runs these kernels on its Triton path.
"""

from __future__ import annotations

from .triton_kernels import CHUNK, chunk_fwd, recurrent_fwd

__all__ = ["CHUNK", "chunk_fwd", "recurrent_fwd"]
