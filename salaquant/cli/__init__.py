"""``salaquant`` command line: the application (`app`, `main`) and its commands, grouped by what they work on.

Importing the command modules registers their commands on `app`, in the order ``--help`` lists them.
"""

from . import models, quantize, runtime  # noqa: I001  (registration order)
from . import check
from .app import app, main

__all__ = ["app", "check", "main", "models", "quantize", "runtime"]
