"""Register the SALA model with transformers' Auto classes as soon as a program uses them.

``import salaquant`` calls `install`: when transformers' auto modules (``AutoConfig``, ``AutoModelForCausalLM``,
``AutoTokenizer`` reading ``config.json``) are loaded already, ``salaquant.model.hf`` is imported at once and
registers the classes; otherwise a finder on ``sys.meta_path`` imports it right after the first of those modules
has loaded. So ``import salaquant; AutoModelForCausalLM.from_pretrained(path)`` works, while importing
salaquant alone loads neither transformers' model code nor any kernel (the command line starts in the time
torch takes to import).
"""

from __future__ import annotations

import importlib
import sys
from importlib.abc import Loader, MetaPathFinder
from importlib.machinery import ModuleSpec, PathFinder
from types import ModuleType
from typing import Any

AUTO_MODULES = ("transformers.models.auto.configuration_auto", "transformers.models.auto.modeling_auto")


def register_now() -> None:
    """Import ``salaquant.model.hf`` (whose import registers the classes) and stop watching imports."""
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _WhenAutoLoads)]
    importlib.import_module("salaquant.model.hf")


def _loading(name: str) -> bool:
    """Whether module ``name`` is being imported right now (in ``sys.modules``, its code still running)."""
    module = sys.modules.get(name)
    return module is not None and bool(getattr(getattr(module, "__spec__", None), "_initializing", False))


class _ThenRegister(Loader):
    """The auto module's own loader, followed by `register_now`."""

    def __init__(self, inner: Loader) -> None:
        self.inner = inner

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.inner.exec_module(module)
        if not any(_loading(m) for m in AUTO_MODULES if m != module.__name__):
            register_now()  # else the auto module still loading (it imported this one) registers when done

    def __getattr__(self, name: str) -> Any:  # get_source, is_package, ... of the wrapped loader
        return getattr(self.inner, name)


class _WhenAutoLoads(MetaPathFinder):
    def find_spec(self, name: str, path: Any = None, target: ModuleType | None = None) -> ModuleSpec | None:
        if name not in AUTO_MODULES:
            return None
        spec = PathFinder.find_spec(name, path, target)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _ThenRegister(spec.loader)
        return spec


def install() -> None:
    """Register now if transformers' auto modules are loaded, else when the first of them loads (idempotent)."""
    if any(m in sys.modules for m in AUTO_MODULES):
        register_now()
    elif not any(isinstance(f, _WhenAutoLoads) for f in sys.meta_path):
        sys.meta_path.insert(0, _WhenAutoLoads())
