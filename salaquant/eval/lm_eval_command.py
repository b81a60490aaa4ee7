"""The ``salaquant-lm-eval`` command: lm-eval's own command line with the ``salaquant`` model registered.

lm-eval is an optional extra; this module imports nothing of it until the command runs, so that a missing extra
ends in one line saying which extra to install instead of an import traceback.
"""

from __future__ import annotations

import sys

EXTRA = "lm-eval"
"""The optional dependency group (pyproject.toml) that installs lm-eval."""


def main() -> None:
    """Run ``salaquant.eval.harness.main``; exit 2 naming the extra when lm-eval is not installed."""
    try:
        from . import harness
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.split(".")[0] != "lm_eval":
            raise
        sys.stderr.write(
            f"error: salaquant-lm-eval needs lm-eval, which is not installed: install the extra with "
            f"pip install 'salaquant[{EXTRA}]'\n"
        )
        raise SystemExit(2) from None
    harness.main()
