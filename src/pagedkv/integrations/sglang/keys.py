"""How `PagedKVStorage` names pages: SGLang page keys as content hashes, ranks as a namespace. Pure Python."""

from __future__ import annotations

import contextlib
import hashlib
import re
from typing import Any

__all__ = ["namespace", "page_key"]


def page_key(key: str) -> bytes:
    """The 32-byte content hash of SGLang page key `key`: its digest for a 64-hex key, else the SHA-256
    of the key's text (sidecar or test keys), so every key fits the page header."""
    if len(key) == 64:
        with contextlib.suppress(ValueError):
            return bytes.fromhex(key)
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


def namespace(config: Any, model_id: str = "") -> str:
    """``<model>_<tp_rank>_<tp_size>`` (``_<pp_size>_<pp_rank>`` appended under pipeline parallelism) of
    an SGLang `HiCacheStorageConfig`, as HiCacheFile suffixes its files; the model is `model_id` when
    given (the ``model_id`` key), else the config's model name; its ``/`` become ``-`` and every
    character but letters, digits, ``.``, ``_`` and ``-`` becomes ``-``."""
    model = "-".join((model_id or config.model_name or "model").split("/"))
    model = re.sub(r"[^A-Za-z0-9._-]", "-", model).lstrip(".") or "model"
    pp = f"_{config.pp_size}_{config.pp_rank}" if config.pp_size > 1 else ""
    return f"{model}_{config.tp_rank}_{config.tp_size}{pp}"
