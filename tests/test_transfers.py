"""The chunk stream of a calibration pass: chunks in the listed order, outputs back where they belong, and (on a GPU)
copies on side streams that never read a chunk after it is overwritten nor write one before its compute ends."""

from __future__ import annotations

import pytest
import torch

from salaquant.calibration.transfers import ChunkStream


def _slow_layer(x: torch.Tensor, spin: int) -> torch.Tensor:
    """A layer whose outputs depend on every input value, made slow on a GPU so that a copy racing it shows."""
    if x.is_cuda and spin:
        torch.cuda._sleep(spin)
    return x.float().cumsum(-1).mul(0.5).add(1.0).to(x.dtype)


def _pass_in_place(hs: list[torch.Tensor], step: int, device: torch.device, spin: int) -> None:
    """Every sample through ``_slow_layer`` chunk by chunk, each output written over its own input."""
    spans = [[(s, min(step, h.shape[1] - s)) for s in range(0, h.shape[1], step)] for h in hs]
    chunks = ChunkStream(device, (h[:, s : s + n] for h, sp in zip(hs, spans, strict=True) for s, n in sp))
    for h, sp in zip(hs, spans, strict=True):
        for s, n in sp:
            chunks.put(_slow_layer(chunks.take(), spin), h[:, s : s + n])
    chunks.done()
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _samples(lengths: list[int], width: int, pin: bool) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    hs = [torch.randn(1, t, width, generator=g).to(torch.bfloat16) for t in lengths]
    return [h.pin_memory() for h in hs] if pin else hs


def test_chunks_in_order_and_outputs_in_place_on_cpu() -> None:
    hs = _samples([5, 12, 1, 7], 6, pin=False)
    expected = [torch.cat([_slow_layer(h[:, s : s + 4], 0) for s in range(0, h.shape[1], 4)], dim=1) for h in hs]
    _pass_in_place(hs, 4, torch.device("cpu"), 0)
    for got, want in zip(hs, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_taking_more_or_fewer_chunks_than_listed_raises() -> None:
    x = torch.zeros(1, 3, 2)
    chunks = ChunkStream(torch.device("cpu"), [x[:, :2], x[:, 2:]])
    chunks.take()
    with pytest.raises(RuntimeError, match="left untaken"):
        chunks.done()
    chunks.take()
    chunks.done()
    with pytest.raises(RuntimeError, match="more chunks than it listed"):
        chunks.take()


@pytest.mark.gpu
def test_side_stream_copies_race_nothing_on_gpu() -> None:
    """Pinned buffers overwritten in place while the next chunk is copied in and slow kernels run: every value must
    equal the serial computation's (a copy back before its compute, or a copy in after its chunk was overwritten,
    would change them)."""
    device = torch.device("cuda")
    lengths = [4096, 300, 1, 2048, 4097, 77]
    want = _samples(lengths, 512, pin=False)
    for h in want:
        for s in range(0, h.shape[1], 1024):
            h[:, s : s + 1024] = _slow_layer(h[:, s : s + 1024].to(device), 0).cpu()
    for _ in range(3):
        hs = _samples(lengths, 512, pin=True)
        _pass_in_place(hs, 1024, device, 2_000_000)
        for got, ref in zip(hs, want, strict=True):
            torch.testing.assert_close(got, ref, rtol=0, atol=0)
