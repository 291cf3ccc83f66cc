"""The per-deployment hash seed: the default `KVCacheParams.kv_hash_seed`.

Prefix-cache keys are chained from a 32-byte seed. A seed nobody outside the
deployment knows means nobody can compute a page's key offline: no crafted
collisions (the attack on predictable hashes reported against vLLM) and no
guessing which prefixes are cached from keys seen in a shared tier. Engines
share pages only when they share the seed, so every process of a deployment
must resolve the same one. In order:

1. ``KVCacheParams(kv_hash_seed=...)``: explicit bytes or 64 hex characters
   (``bytes(32)`` gives MAX's all-zero seed).
2. ``PAGEDKV_HASH_SEED``: 64 hex characters (set it on every machine that
   shares a Redis tier or a disk directory).
3. The seed file ``PAGEDKV_HASH_SEED_FILE`` (default
   ``$XDG_CONFIG_HOME/pagedkv/hash_seed``, else ``~/.config/pagedkv/hash_seed``):
   32 random bytes written once, mode 0600, race-free (the first process to
   link it wins; every other reads the winner's).
4. When the file cannot be read or created: 32 random bytes for this process
   only, with a warning (no page is shared across processes then).
"""

from __future__ import annotations

import os
import tempfile
import threading
import warnings
from pathlib import Path

__all__ = ["SEED_ENV", "SEED_FILE_ENV", "deployment_seed", "seed_file_path"]

SEED_ENV = "PAGEDKV_HASH_SEED"
SEED_FILE_ENV = "PAGEDKV_HASH_SEED_FILE"
_lock = threading.Lock()
_cache: dict[tuple[str | None, str], bytes] = {}


def seed_file_path() -> Path:
    """Where the seed file is (created or not): `PAGEDKV_HASH_SEED_FILE` or the config directory."""
    explicit = os.environ.get(SEED_FILE_ENV)
    if explicit:
        return Path(explicit)
    config = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(config) / "pagedkv" / "hash_seed"


def deployment_seed() -> bytes:
    """The 32-byte seed of this deployment (steps 2-4 above); the same value for the process's lifetime
    unless the environment variables change. Side effect: may create the seed file."""
    env = os.environ.get(SEED_ENV)
    path = str(seed_file_path())
    with _lock:
        cached = _cache.get((env, path))
        if cached is not None:
            return cached
        seed = _from_env(env) if env else _from_file(Path(path))
        _cache[(env, path)] = seed
        return seed


def _from_env(text: str) -> bytes:
    try:
        seed = bytes.fromhex(text.strip())
    except ValueError:
        raise ValueError(f"{SEED_ENV}={text!r} is not hex") from None
    if len(seed) != 32:
        raise ValueError(f"{SEED_ENV} holds {len(seed)} bytes; it must hold exactly 32 (64 hex characters)")
    return seed


def _from_file(path: Path) -> bytes:
    try:
        return _read(path)
    except FileNotFoundError:
        pass
    except (OSError, ValueError) as exc:
        return _ephemeral(f"cannot read {path} ({exc})")
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".hash_seed.")
        try:
            os.write(fd, os.urandom(32))
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)  # atomic, never overwrites: a concurrent creator's seed wins
        except FileExistsError:
            pass
        finally:
            os.unlink(tmp)
        return _read(path)
    except (OSError, ValueError) as exc:
        return _ephemeral(f"cannot create {path} ({exc})")


def _read(path: Path) -> bytes:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    with os.fdopen(fd, "rb") as f:
        seed = f.read(33)
    if len(seed) != 32:
        raise ValueError(f"the seed file holds {len(seed)} bytes, not 32")
    return seed


def _ephemeral(why: str) -> bytes:
    warnings.warn(
        f"pagedkv: {why}; using a random hash seed for this process only, so no other process shares its "
        f"pages. Set {SEED_ENV} (64 hex characters) or {SEED_FILE_ENV}.",
        RuntimeWarning,
        stacklevel=4,
    )
    return os.urandom(32)
