"""How many programs a GPU runs at once (``programs_per_sm``, ``resident_programs``) and the one-wave split-K
(``wave_split``): the arithmetic against hand-computed cases, and on a GPU against the hardware itself: programs
that wait for each other all finish waiting only if they were all resident together."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from salaquant.kernels.device import programs_per_sm, resident_programs
from salaquant.kernels.host import wave_split

pytestmark = pytest.mark.random_inputs

H100 = (132, 65536, 2048, 233472)  # SMs, registers, threads and shared bytes per SM (sm_90)


@pytest.mark.parametrize(
    ("regs", "warps", "shared", "expected"),
    [
        (70, 4, 1024, 7),  # 72 x 32 = 2304 registers a warp: 28 warps
        (64, 4, 1024, 8),
        (56, 4, 1024, 9),  # 1792 a warp: 36 warps
        (96, 4, 1024, 5),
        (168, 4, 1024, 3),
        (255, 4, 0, 2),  # 8192 a warp: 8 warps
        (32, 1, 0, 32),  # at most 32 programs
        (32, 4, 0, 16),  # 2048 threads
        (32, 4, 100 * 1024, 2),  # shared memory, with 1 KiB reserved per program
    ],
)
def test_programs_per_sm_by_hand(regs: int, warps: int, shared: int, expected: int) -> None:
    assert programs_per_sm(regs, warps, shared, H100) == expected


def test_wave_split_fills_one_wave() -> None:
    # gate_up at 16 rows: 512 column tiles, 32 groups; 924 programs fit (7 per SM), or 1056 (8 per SM)
    assert wave_split(512, 32, 924) == 1
    assert wave_split(512, 32, 1056) == 2
    # down: 64 tiles, 128 groups, 924 fit: 14 asked, realised as 13 splits of 10 groups (none empty)
    assert wave_split(64, 128, 924) == 13
    assert 64 * wave_split(64, 128, 924) <= 924
    assert wave_split(64, 128, 924, min_tiles=16) == 8  # at least 16 groups per split
    assert wave_split(2048, 32, 924) == 1  # the tiles alone exceed a wave
    for n_tiles, k_tiles, resident in [(3, 7, 100), (64, 32, 924), (192, 32, 1188), (1, 1, 5)]:
        s = wave_split(n_tiles, k_tiles, resident)
        per = -(-k_tiles // s)
        assert -(-k_tiles // per) == s and (s - 1) * per < k_tiles  # realised: no empty split
        assert s == 1 or n_tiles * s <= resident


@triton.jit
def _rendezvous_kernel(cnt_ptr, seen_ptr, data_ptr, out_ptr, limit, WIDTH: tl.constexpr):
    """Each program holds ``WIDTH`` values in registers, arrives, then waits (at most ``limit`` polls) until all the
    programs of the grid have arrived, and records how many it saw."""
    pid = tl.program_id(0)
    offs = tl.arange(0, WIDTH)
    held = tl.load(data_ptr + offs)
    target = tl.num_programs(0)
    tl.atomic_add(cnt_ptr, 1)
    arrived = tl.atomic_add(cnt_ptr, 0)
    i = 0
    while (arrived < target) & (i < limit):
        arrived = tl.atomic_add(cnt_ptr, 0)
        i += 1
    tl.store(seen_ptr + pid, arrived)
    tl.store(out_ptr + pid * WIDTH + offs, held * 2.0)


@pytest.mark.gpu
@pytest.mark.parametrize("width", [128, 128 * 64])
def test_gpu_resident_programs_all_run_at_once(width: int) -> None:
    """With ``resident_programs`` programs every one sees all arrive; with one more, some give up waiting (the last
    can only start once another has finished)."""
    dev = torch.device("cuda")
    meta = {"WIDTH": width, "num_warps": 4}
    data = torch.randn(width, device=dev)
    args = (torch.int32, torch.int32, data, torch.float32, 200_000)
    resident = resident_programs(_rendezvous_kernel, args, meta, dev)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    assert resident % sms == 0 and resident >= sms
    for n, all_meet in ((resident, True), (resident + 1, False)):
        cnt = torch.zeros(1, dtype=torch.int32, device=dev)
        seen = torch.zeros(n, dtype=torch.int32, device=dev)
        out = torch.empty(n, width, device=dev)
        _rendezvous_kernel[(n,)](cnt, seen, data, out, 200_000, **meta)
        torch.cuda.synchronize()
        assert int(cnt) == n  # one arrival per program
        torch.testing.assert_close(out, (data * 2).expand(n, width))
        met = bool((seen == n).all())
        assert met == all_meet, f"{n} programs, {resident} resident: saw {int(seen.min())}..{int(seen.max())}"
