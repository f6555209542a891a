"""Third-party modules imported on first use, so ``hotfit --help`` does not pay for run-time libraries.

``lazy_module("httpx")`` returns the module object at once and executes it on its first attribute
access (the standard library's :class:`importlib.util.LazyLoader` recipe). Only for third-party
modules whose names are used inside functions (``except httpx.HTTPError``, ``httpx.AsyncClient(...)``);
hotfit's own modules are imported normally, at the top, as the layers contract wants. Why: httpx
(with the click and rich it pulls in for its own CLI) is ~0.1 s of every start, and most commands
never open a connection.
"""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType

__all__ = ["lazy_module"]


def lazy_module(name: str) -> ModuleType:
    """``name`` as it is in ``sys.modules`` if already imported, else a module executed on first use."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.find_spec(name)
    if spec is None or spec.loader is None:
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)
    loader = importlib.util.LazyLoader(spec.loader)
    spec.loader = loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    loader.exec_module(module)
    return module
