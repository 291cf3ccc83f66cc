"""The stored page format of the disk and Redis tiers: an 80-byte header, then the page's bytes.

    offset  size  field
    0       4     magic b"PKVP"
    4       2     format version (1)
    6       1     prefix hash algorithm (1 sha256, 2 sha256_64, 3 xxh3_128)
    7       1     checksum algorithm (1 crc32, 2 xxh3_64)
    8       1     key length (bytes of the content hash)
    9       3     zero
    12      16    layout fingerprint (`layout_fingerprint`)
    28      32    content hash, zero-padded
    60      8     payload length
    68      8     payload checksum
    76      4     zero

All integers little-endian. The payload is the page's row: every cache's,
every TP shard's values then scales, as `PageMover` lays it out. No pickle:
a reader checks every field and the checksum before a byte reaches the KV
cache (`check_page`), and refuses the page otherwise.
"""

from __future__ import annotations

import hashlib
import struct
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "HEADER_SIZE",
    "PageHeader",
    "check_page",
    "checksum",
    "encode_header",
    "key_bytes",
    "layout_fingerprint",
]

MAGIC = b"PKVP"
VERSION = 1
_HEADER = struct.Struct("<4sHBBB3x16s32sQQ4x")
HEADER_SIZE = _HEADER.size  # 80
HASH_ALGO_IDS = {"sha256": 1, "sha256_64": 2, "xxh3_128": 3}
CRC32, XXH3_64 = 1, 2


def _xxh3_64() -> Callable[[Any], int] | None:
    try:
        import xxhash
    except ImportError:  # pragma: no cover - the [tiers] extra installs it
        return None
    return xxhash.xxh3_64_intdigest  # type: ignore[no-any-return]


_XXH3 = _xxh3_64()
DEFAULT_CHECKSUM = XXH3_64 if _XXH3 is not None else CRC32


def checksum(payload: Any, algo: int = DEFAULT_CHECKSUM) -> int:
    """Checksum of a bytes-like `payload`: xxh3_64 (with the xxhash package) or crc32."""
    if algo == XXH3_64:
        if _XXH3 is None:
            raise ValueError("this page's checksum is xxh3_64, which needs the xxhash package")
        return _XXH3(payload)
    if algo == CRC32:
        return zlib.crc32(payload)
    raise ValueError(f"unknown checksum algorithm id {algo}")


def key_bytes(block_hash: bytes | int) -> bytes:
    """A prefix hash as bytes: as is, or an int (sha256_64) as 8 big-endian bytes."""
    if isinstance(block_hash, bytes):
        return block_hash
    return block_hash.to_bytes(8, "big", signed=True)


def layout_fingerprint(describe: Sequence[object], model_id: str = "") -> bytes:
    """16 bytes identifying what a page's bytes mean: `describe` lists every field that shapes them
    (dtype, page size, heads, head_dim, layers, TP degree, ...; see `offload.layout`)."""
    text = repr((VERSION, model_id, tuple(describe))).encode()
    return hashlib.blake2b(text, digest_size=16).digest()


@dataclass(frozen=True)
class PageHeader:
    """The decoded fields of a stored page's header."""

    version: int
    hash_algo: int
    checksum_algo: int
    fingerprint: bytes
    key: bytes
    payload_length: int
    checksum: int


def encode_header(key: bytes, payload: Any, fingerprint: bytes, hash_algo: str) -> bytes:
    """The header of `payload` (bytes-like) stored under `key`."""
    if len(key) > 32 or len(fingerprint) != 16:
        raise ValueError(f"key of {len(key)} bytes (max 32) or fingerprint of {len(fingerprint)} (must be 16)")
    length = memoryview(payload).nbytes
    return _HEADER.pack(
        MAGIC, VERSION, HASH_ALGO_IDS[hash_algo], DEFAULT_CHECKSUM, len(key), fingerprint, key, length,
        checksum(payload),
    )  # fmt: skip


def decode_header(raw: bytes | memoryview) -> PageHeader | None:
    """The header at the start of `raw`, or None when it is not one (short, or wrong magic)."""
    if len(raw) < HEADER_SIZE:
        return None
    magic, version, algo, check, key_len, fingerprint, key, length, value = _HEADER.unpack_from(raw)
    if magic != MAGIC or key_len > 32:
        return None
    return PageHeader(version, algo, check, fingerprint, bytes(key[:key_len]), length, value)


def check_page(
    header: PageHeader | None, payload: Any, key: bytes, fingerprint: bytes, hash_algo: str, row_bytes: int
) -> str | None:
    """None when `payload` is the valid page `key` of this layout; otherwise why it is refused."""
    if header is None:
        return "not a pagedkv page (bad magic or truncated header)"
    if header.version != VERSION:
        return f"format version {header.version}, this reader knows {VERSION}"
    if header.hash_algo != HASH_ALGO_IDS[hash_algo]:
        return f"hash algorithm id {header.hash_algo}, expected {HASH_ALGO_IDS[hash_algo]} ({hash_algo})"
    if header.fingerprint != fingerprint:
        return "layout fingerprint differs (another model, dtype, page size, head count or TP degree)"
    if header.key != key:
        return "stored under another content hash"
    if header.payload_length != row_bytes or memoryview(payload).nbytes != row_bytes:
        return (
            f"payload of {memoryview(payload).nbytes} bytes (header says {header.payload_length}), expected {row_bytes}"
        )
    try:
        ok = checksum(payload, header.checksum_algo) == header.checksum
    except ValueError as exc:
        return str(exc)
    return None if ok else "checksum mismatch"
