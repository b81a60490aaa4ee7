"""Grouped launch order of output tiles, shared by the tiled GEMM kernels (W4A16 ``tiled``, NVFP4 ``dot_kernel``).

Programs of a 1-D grid that walk a 2-D grid of output tiles row by row reload every tile of the other operand once
per row. Grouping ``GROUP`` rows of tiles and sweeping the columns with the whole group instead keeps the tiles that
the group shares in L2.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["grouped_tile"]


@triton.jit
def grouped_tile(pid, tiles_major, tiles_minor, GROUP: tl.constexpr):
    """``(major, minor)`` tile of program ``pid`` over ``tiles_major x tiles_minor`` tiles: ``GROUP`` consecutive
    major tiles (fewer in the last group) sweep every minor tile together, the major index varying fastest."""
    width = GROUP * tiles_minor
    first = (pid // width) * GROUP
    here = tl.minimum(tiles_major - first, GROUP)
    return first + (pid % width) % here, (pid % width) // here
