"""Hash what the user-facing runs write, so that a refactor can be shown to leave every byte as it was.

Runs ``salaquant demo --quick``, ``benchmarks/quality.py --smoke`` and every shipped recipe on ``models/sala-tiny``
with the shipped calibration sample, then lists the sha256 of each weight shard and each result's numbers
(wall times and paths left out) in ``OUT/hashes.txt``. Run it on two commits and ``diff`` the lists::

    python tools/byte_check.py --out /tmp/before   # on the old commit
    python tools/byte_check.py --out /tmp/after    # on the new one
    diff /tmp/before/hashes.txt /tmp/after/hashes.txt
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "models" / "sala-tiny"
CALIB = ROOT / "calib" / "sala-tiny-calib.jsonl"
# keys whose values change from run to run, not with the computation (``*_s``: seconds)
VOLATILE = ("seconds", "time", "wall", "date", "elapsed", "rate")


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _volatile(key: str) -> bool:
    return key.lower().endswith("_s") or any(word in key.lower() for word in VOLATILE)


def _stable(obj: Any, folders: dict[str, str]) -> Any:
    """``obj`` without the keys `_volatile` names, and with each path of ``folders`` written as its name: what a
    computation, not a clock or a folder, decides."""
    if isinstance(obj, dict):
        return {k: _stable(v, folders) for k, v in obj.items() if not _volatile(k)}
    if isinstance(obj, list):
        return [_stable(v, folders) for v in obj]
    if isinstance(obj, str):
        for path, name in folders.items():
            obj = obj.replace(path, name)
    return obj


def _hash_tree(folder: Path, root: Path, checkout: str) -> list[str]:
    lines = []
    for path in sorted(folder.rglob("*")):
        if path.suffix == ".safetensors" or path.name == "quantize_config.json":
            lines.append(f"{_sha(path)}  {path.relative_to(root)}")
        elif path.suffix == ".json" and path.name in ("demo.json", "quality.json"):
            folders = {str(root.resolve()): "OUT", checkout: "CHECKOUT"}
            stable = json.dumps(_stable(json.loads(path.read_text()), folders), sort_keys=True)
            lines.append(f"{hashlib.sha256(stable.encode()).hexdigest()}  {path.relative_to(root)} (numbers)")
    return lines


def _run(args: list[str], log: Path) -> None:
    with log.open("w") as fh:
        proc = subprocess.run(args, stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(args)} failed ({proc.returncode}); see {log}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="A new folder for the runs and hashes.txt.")
    parser.add_argument("--skip-quality", action="store_true", help="Leave out the quality smoke run (slowest).")
    parser.add_argument(
        "--hash-only",
        metavar="CHECKOUT",
        help="Run nothing: hash the runs already in --out, made from the checkout at this path.",
    )
    args = parser.parse_args()
    out: Path = args.out
    if args.hash_only is not None:
        _write(out, args.hash_only)
        return
    out.mkdir(parents=True, exist_ok=False)
    cli = [sys.executable, "-m", "salaquant"]
    _run([*cli, "demo", "--quick", "--out", str(out / "demo")], out / "demo.log")
    from salaquant.recipe import shipped_recipes

    for name in sorted(shipped_recipes()):
        run = [*cli, "run", name, "--input", str(MODEL), "--output", str(out / name), "--calib", str(CALIB)]
        _run(run, out / f"{name}.log")
    if not args.skip_quality:
        bench = ROOT / "benchmarks" / "quality.py"
        _run([sys.executable, str(bench), "--smoke", "--out", str(out / "quality")], out / "quality.log")
    _write(out, str(ROOT))


def _write(out: Path, checkout: str) -> None:
    lines = _hash_tree(out, out, checkout)
    (out / "hashes.txt").write_text("\n".join(lines) + "\n")
    print(f"{len(lines)} hashes in {out / 'hashes.txt'}")


if __name__ == "__main__":
    main()
