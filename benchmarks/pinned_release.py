"""Does freeing a pinned CPU buffer give its memory back to the system on this torch build?

Allocates one pinned buffer of ``--gib`` GiB the way the calibration engine does, drops it, empties PyTorch's
pinned-memory cache with each API this build has, and prints the process's resident memory after each step.
"""

from __future__ import annotations

import argparse
import json

import torch

from salaquant.host_memory import process_memory


def rss_gib() -> float:
    return round((process_memory() or 0) / 2**30, 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--gib", type=float, default=4.0)
    args = ap.parse_args()
    torch.zeros(1, device="cuda")
    out: dict[str, object] = {"torch": torch.__version__, "start": rss_gib()}
    out["apis"] = {
        "torch.accelerator.empty_host_cache": hasattr(torch.accelerator, "empty_host_cache"),
        "torch._C._host_emptyCache": hasattr(torch._C, "_host_emptyCache"),
    }
    buf = torch.empty(int(args.gib * 2**30), dtype=torch.uint8, pin_memory=True)
    buf.fill_(1)
    out["allocated"] = rss_gib()
    del buf
    out["freed"] = rss_gib()
    if hasattr(torch.accelerator, "empty_host_cache"):
        torch.accelerator.empty_host_cache()
        out["after_accelerator_empty_host_cache"] = rss_gib()
    if hasattr(torch._C, "_host_emptyCache"):
        torch._C._host_emptyCache()
        out["after__host_emptyCache"] = rss_gib()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
