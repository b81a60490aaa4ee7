"""Register the SALA model with transformers (and GPTQModel) as soon as a program uses them, in any import order.

``import salaquant`` calls `install`. Each `Hook` names a library, the modules whose loading means its registry
exists (transformers' auto modules, GPTQModel's model map) and the salaquant module whose import registers SALA
there (``salaquant.model.hf``, ``salaquant.model.gptqmodel_definition``). Registration runs at once when the
library is already loaded; otherwise a finder on ``sys.meta_path`` wraps the loaders of that library's modules
and registers right after the outermost of them has finished executing. Not earlier: the registering module
imports the library's public names (``transformers.PreTrainedModel`` imports ``transformers.quantizers``), so
running it while, say, ``transformers.quantizers`` is itself half-initialised (it loads the auto modules) would
fail. So ``import salaquant; AutoModelForCausalLM.from_pretrained(path)`` and ``import salaquant; import
gptqmodel; GPTQModel.load(path)`` both work, while importing salaquant alone loads neither library.

A registration that raises propagates to the import that triggered it and stays pending (retried at the
library's next module import), so it is never lost silently.
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass
from importlib.abc import Loader, MetaPathFinder
from importlib.machinery import ModuleSpec, PathFinder
from types import ModuleType
from typing import Any


@dataclass(frozen=True)
class Hook:
    """Import ``register`` once ``package`` has loaded one of ``triggers`` and no module of it is mid-import."""

    package: str
    triggers: tuple[str, ...]
    register: str

    def owns(self, name: str) -> bool:
        return name == self.package or name.startswith(self.package + ".")

    def ready(self, finished: str = "") -> bool:
        """A trigger module has loaded and no module of the package but ``finished`` is still executing."""

        def loading(name: str) -> bool:
            return name != finished and _loading(name)

        if not any(m in sys.modules and not loading(m) for m in self.triggers):
            return False
        return not any(self.owns(name) and loading(name) for name in list(sys.modules))


HOOKS = (
    Hook(
        "transformers",
        ("transformers.models.auto.configuration_auto", "transformers.models.auto.modeling_auto"),
        "salaquant.model.hf",
    ),
    Hook("gptqmodel", ("gptqmodel.models.auto",), "salaquant.model.gptqmodel_definition"),
)

_pending: list[Hook] = []
_registering = False


def _loading(name: str) -> bool:
    """Whether module ``name`` is being imported right now (in ``sys.modules``, its code still running)."""
    module = sys.modules.get(name)
    return module is not None and bool(getattr(getattr(module, "__spec__", None), "_initializing", False))


def _register_ready(finished: str = "") -> None:
    """Run every pending hook whose package is ready (``finished``: a module whose code has just run, which
    importlib still marks as initialising); stop watching imports when none is left. Not re-entered from the
    imports a registering module makes itself."""
    global _registering
    if _registering:
        return
    _registering = True
    try:
        for hook in list(_pending):
            if hook.ready(finished):
                importlib.import_module(hook.register)  # raises: the hook stays pending
                _pending.remove(hook)
    finally:
        _registering = False
    if not _pending:
        sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _Watcher)]


class _ThenRegister(Loader):
    """A watched module's own loader; when the outermost watched module of its package has executed,
    `_register_ready` (the package's ``sys.modules`` are scanned only then, not after each of its modules)."""

    executing: dict[str, int] = {}  # noqa: RUF012  (package -> watched modules of it now executing)

    def __init__(self, inner: Loader, package: str) -> None:
        self.inner = inner
        self.package = package

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        depth = self.executing
        depth[self.package] = depth.get(self.package, 0) + 1
        try:
            self.inner.exec_module(module)
        finally:
            depth[self.package] -= 1
        if depth[self.package] == 0:
            _register_ready(finished=module.__name__)

    def __getattr__(self, name: str) -> Any:  # get_source, is_package, get_resource_reader ... of the wrapped loader
        return getattr(self.inner, name)


class _Watcher(MetaPathFinder):
    def find_spec(self, name: str, path: Any = None, target: ModuleType | None = None) -> ModuleSpec | None:
        if not any(hook.owns(name) for hook in _pending):
            return None
        spec = PathFinder.find_spec(name, path, target)
        if spec is None or spec.loader is None:
            return None
        package = next(hook.package for hook in _pending if hook.owns(name))
        spec.loader = _ThenRegister(spec.loader, package)
        return spec


def install() -> None:
    """Register with every library already loaded; watch imports for the others (idempotent)."""
    for hook in HOOKS:
        if hook not in _pending and hook.register not in sys.modules:
            _pending.append(hook)
    if any(hook.ready() for hook in _pending):
        _register_ready()
    if _pending and not any(isinstance(f, _Watcher) for f in sys.meta_path):
        sys.meta_path.insert(0, _Watcher())
