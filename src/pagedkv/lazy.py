"""Lazy package exports: a package's public names load their module on first use (PEP 562).

`import pagedkv` (and `pagedkv.offload`, `pagedkv.integrations.*`) must not import torch, redis, vLLM
or SGLang until a name that needs them is used; each such package maps its public names to the module
defining them and takes its ``__getattr__`` and ``__dir__`` from `lazy_exports`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(
    package: str, exports: Mapping[str, str], namespace: dict[str, Any]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for `package`: a name of `exports` (name -> defining module) is imported on
    first access and cached in `namespace` (the package's ``globals()``), so later lookups are plain; any
    other name raises ``AttributeError`` naming the package."""

    def get(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def listing() -> list[str]:
        return sorted([*namespace, *exports])

    return get, listing
