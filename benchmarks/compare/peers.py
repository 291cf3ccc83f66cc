"""Loading the real vLLM / SGLang cache managers as `CacheAdapter` peers of pagedkv.

Both engines are optional and heavy: nothing here imports them at module import
time. Install them into a separate environment with ``make peers`` (CPU torch +
``requirements/peers-cpu.txt`` with ``--no-deps``); a plain pip install would
pull a CUDA torch.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

__all__ = ["PEERS", "PeerUnavailable", "load_peer", "import_peer", "ensure_torchvision_ops"]

# peer name -> (module, adapter class)
PEERS: dict[str, tuple[str, str]] = {
    "vllm": ("benchmarks.compare.peer_vllm", "VllmAdapter"),
    "vllm-hybrid": ("benchmarks.compare.peer_vllm_hybrid", "VllmHybridAdapter"),
    "sglang": ("benchmarks.compare.peer_sglang", "SglangAdapter"),
}

_T = TypeVar("_T")
_TV_LIB: list[Any] = []  # keeps the torchvision op-schema fragment alive (dropping it undefines the ops)


class PeerUnavailable(RuntimeError):  # noqa: N818 (the name callers catch)
    """The peer engine cannot be imported here; the message carries the import error."""


def import_peer(engine: str, load: Callable[[], _T]) -> _T:
    """Run `load` (the engine's imports); any failure becomes `PeerUnavailable` naming `engine`."""
    try:
        ensure_torchvision_ops()
        return load()
    except PeerUnavailable:
        raise
    except Exception as exc:  # ImportError, and RuntimeErrors raised by half-installed CUDA extensions
        raise PeerUnavailable(f"{engine} is not importable: {type(exc).__name__}: {exc}") from exc


def ensure_torchvision_ops() -> None:
    """Declare the ``torchvision::nms`` / ``qnms`` op schemas (no kernels) unless already defined.

    PyPI's torchvision is a CUDA build whose ``_C`` never loads against torch+cpu; its
    ``_meta_registrations`` then fails on the missing ops. transformers (imported by both
    vLLM and SGLang) imports torchvision when it is installed, so the schemas must exist
    first. A no-op without torchvision or with a real
    CPU build, and idempotent. Not on any measured path.
    """
    if _TV_LIB:
        return
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return
    import torch

    for lib_path in Path(next(iter(spec.submodule_search_locations))).glob("_C*.so"):
        try:
            torch.ops.load_library(str(lib_path))  # a build that loads registers the real ops
            return
        except (OSError, RuntimeError):
            pass
    lib = torch.library.Library("torchvision", "FRAGMENT")
    for name in ("nms", "qnms"):
        try:
            getattr(torch.ops.torchvision, name)  # declared already (by someone else in this process)
        except (AttributeError, RuntimeError):
            lib.define(f"{name}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _TV_LIB.append(lib)


def load_peer(name: str, **kwargs: Any) -> Any:
    """The adapter of peer `name` ("vllm", "vllm-hybrid" or "sglang") built with `kwargs`.

    Raises `PeerUnavailable` (with the import error text) when the engine is not
    installed, and `ValueError` for an unknown name.
    """
    if name not in PEERS:
        raise ValueError(f"unknown peer {name!r}; expected one of {sorted(PEERS)}")
    module, cls = PEERS[name]
    return getattr(importlib.import_module(module), cls)(**kwargs)
