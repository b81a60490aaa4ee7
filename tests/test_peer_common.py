"""What the peer runners share (``benchmarks/peers/peer_common.py``): reading the source checkpoint and the
calibration samples every tool is given."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from safetensors import safe_open

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks" / "peers"))

from peer_common import calibration_samples, read_source  # noqa: E402

SHARDED = ROOT / "models" / "sala-small"  # two shards and an index
CALIB = ROOT / "calib" / "sala-tiny-calib.jsonl"


def test_read_source_takes_every_shard() -> None:
    """A sharded checkpoint is read whole: every tensor of every shard, by name, equal to safetensors' own read."""
    shards = sorted(SHARDED.glob("*.safetensors"))
    assert len(shards) == 2
    want: dict[str, torch.Tensor] = {}
    for shard in shards:
        with safe_open(str(shard), framework="pt") as f:
            want.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118
    got = read_source(SHARDED)
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) and got[k].dtype == want[k].dtype for k in want)


def test_calibration_samples_with_and_without_bos() -> None:
    """``bos=False`` gives the same samples without their leading BOS token."""
    tok, with_bos, info = calibration_samples(SHARDED, str(CALIB), 3, 64)
    _, without, _ = calibration_samples(SHARDED, str(CALIB), 3, 64, bos=False)
    assert info["samples"] == 3 and len(without) == 3
    assert all(int(s[0]) == tok.bos_token_id for s in with_bos)
    assert all(int(s[0]) != tok.bos_token_id for s in without)
    assert all(torch.equal(a[1:], b[: len(a) - 1]) for a, b in zip(with_bos, without, strict=True))
