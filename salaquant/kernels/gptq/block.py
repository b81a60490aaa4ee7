"""One block of columns as the GPTQ column sweep reads and writes it."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ColumnBlock:
    """The operands of one block ``[R, C]`` (rows are output features, columns input features) and its grid.

    ``w1`` is updated in place on the swept columns and after them; ``codes`` (int32) and ``err`` (``w1``'s dtype)
    receive the swept columns' codes and scaled errors; ``hinv1 [C, C]`` is the block's part of the upper Cholesky
    factor of the inverse Hessian. The grid is the integers ``0 .. maxq`` around ``zero``, or with ``e2m1`` NVFP4's
    (``zero`` and ``maxq`` unused). A block is checked once, when it is made.
    """

    w1: torch.Tensor
    codes: torch.Tensor
    err: torch.Tensor
    hinv1: torch.Tensor
    zero: int = 0
    maxq: int = 0
    e2m1: bool = False

    def __post_init__(self) -> None:
        w1, codes, err, hinv1 = self.w1, self.codes, self.err, self.hinv1
        r, c = w1.shape
        if codes.shape != (r, c) or err.shape != (r, c) or hinv1.shape != (c, c):
            raise ValueError(
                f"w1 {tuple(w1.shape)}, codes {tuple(codes.shape)}, err {tuple(err.shape)}, hinv1 "
                f"{tuple(hinv1.shape)}: expected [R, C], [R, C], [R, C], [C, C]"
            )
        if codes.dtype != torch.int32 or err.dtype != w1.dtype or hinv1.dtype != w1.dtype:
            raise ValueError("codes must be int32 and err, hinv1 of w1's dtype")

    def check_scale(self, scale: torch.Tensor) -> None:
        """``scale`` is ``[R]`` (one step per row for every column swept) or ``[R, C]``, of ``w1``'s dtype."""
        r, c = self.w1.shape
        if scale.shape not in ((r,), (r, c)):
            raise ValueError(f"scale {tuple(scale.shape)}: expected [{r}] or [{r}, {c}]")
        if scale.dtype != self.w1.dtype:
            raise ValueError(f"scale is {scale.dtype}: expected w1's dtype {self.w1.dtype}")
