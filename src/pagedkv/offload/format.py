"""The stored page format of the disk and Redis tiers: a 112-byte header, then the page's bytes.

    offset  size  field
    0       4     magic b"PKVP"
    4       2     format version (2)
    6       1     prefix hash algorithm (1 sha256, 2 sha256_64, 3 xxh3_128)
    7       1     integrity algorithm (1 crc32, 2 xxh3_64, 3 HMAC-SHA256)
    8       1     key length (bytes of the content hash)
    9       3     zero
    12      16    layout fingerprint (`layout_fingerprint`)
    28      32    content hash, zero-padded
    60      8     payload length
    68      32    tag: the payload checksum (8 bytes, then zeros), or HMAC-SHA256 over
                  bytes 0..67 of this header followed by the payload
    100     12    zero

All integers little-endian. The payload is the page's row: every cache's,
every TP shard's values then scales, as `PageMover` lays it out. A writer
whose row is not one buffer (an SGLang host page's K and V halves) passes
it as parts (a list or tuple of bytes-like objects, in order): the checksum,
HMAC and stored bytes are those of the parts' concatenation. No pickle:
a reader checks every field and the tag before a byte reaches the KV cache
(`check_page`), and refuses the page otherwise.

A checksum catches corruption (a torn write, a flipped bit, a truncated
file), not forgery: whoever can write to a shared tier can compute it. With
a key (`KVConnectorConfig.tier_hmac_key`) the tag is an HMAC over the header
fields and the payload, so only holders of the key write pages that others
load; a keyed reader refuses every unsigned or wrongly signed page, and the
header binds the page to its content hash and layout, so a valid page copied
under another key or into another layout is refused too.
Version 1 pages (80-byte header, checksum only) are refused and recomputed.

Tiers keep pages under a namespace (`tier_namespace`): the layout fingerprint,
and for signed pages the key's public id (`key_id`), so engines with different
keys, and unsigned engines, never look up or write each other's page names. A
page a reader refuses stays where it is: it is a miss for that reader, never
deleted by it (see docs/SECURITY.md).
"""

from __future__ import annotations

import hashlib
import hmac
import struct
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "HEADER_SIZE",
    "PageHeader",
    "check_header",
    "check_page",
    "checksum",
    "encode_header",
    "key_bytes",
    "key_id",
    "layout_fingerprint",
    "mac",
    "payload_nbytes",
    "payload_parts",
    "seal",
    "tier_namespace",
]

MAGIC = b"PKVP"
VERSION = 2
_HEADER = struct.Struct("<4sHBBB3x16s32sQ32s12x")
HEADER_SIZE = _HEADER.size  # 112
_SIGNED = 68  # bytes of the header an HMAC covers (everything before the tag)
HASH_ALGO_IDS = {"sha256": 1, "sha256_64": 2, "xxh3_128": 3}
CRC32, XXH3_64, HMAC_SHA256 = 1, 2, 3
MIN_MAC_KEY_BYTES = 16
KEY_ID_LABEL = b"pagedkv tier key id\x00v1"  # what `key_id` signs: fixed, so the id names the key alone


def _xxh3_64() -> Callable[[Any], int] | None:
    try:
        import xxhash
    except ImportError:  # pragma: no cover - the [tiers] extra installs it
        return None
    return xxhash.xxh3_64_intdigest  # type: ignore[no-any-return]


def _xxh3_64_state() -> Callable[[], Any] | None:
    try:
        import xxhash
    except ImportError:  # pragma: no cover - the [tiers] extra installs it
        return None
    return xxhash.xxh3_64  # type: ignore[no-any-return]


_XXH3 = _xxh3_64()
_XXH3_STATE = _xxh3_64_state()
DEFAULT_CHECKSUM = XXH3_64 if _XXH3 is not None else CRC32


def _byte_view(part: Any) -> memoryview:
    view = part if isinstance(part, memoryview) else memoryview(part)
    return view if view.ndim == 1 and view.format == "B" else view.cast("B")


def payload_parts(payload: Any) -> list[memoryview]:
    """The flat byte views of `payload`: one bytes-like object, or a list / tuple of them (its parts,
    in order). Nothing is copied; a part must be C-contiguous."""
    if isinstance(payload, list | tuple):
        return [_byte_view(part) for part in payload]
    return [_byte_view(payload)]


def payload_nbytes(payload: Any) -> int:
    """Bytes of `payload` (one bytes-like object, or the sum of its parts)."""
    if isinstance(payload, list | tuple):
        return sum(memoryview(part).nbytes for part in payload)
    return memoryview(payload).nbytes


def checksum(payload: Any, algo: int = DEFAULT_CHECKSUM) -> int:
    """Checksum of `payload` (bytes-like, or a list / tuple of parts checksummed as their concatenation):
    xxh3_64 (with the xxhash package) or crc32."""
    parts = isinstance(payload, list | tuple)
    if algo == XXH3_64:
        if _XXH3 is None or _XXH3_STATE is None:
            raise ValueError("this page's checksum is xxh3_64, which needs the xxhash package")
        if not parts:
            return _XXH3(payload)
        state = _XXH3_STATE()
        for part in payload:
            state.update(part)
        return int(state.intdigest())
    if algo == CRC32:
        if not parts:
            return zlib.crc32(payload)
        crc = 0
        for part in payload:
            crc = zlib.crc32(part, crc)
        return crc
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


def key_id(mac_key: bytes) -> str:
    """The public name of a `tier_hmac_key`: 16 hex characters (8 bytes) of HMAC-SHA256 under the key of a
    fixed label. One way (it tells nothing about the key, and no page can be signed with it), so it is safe
    to publish and log; engines with the same key have the same id, engines with another key another id."""
    return hmac.new(mac_key, KEY_ID_LABEL, hashlib.sha256).hexdigest()[:16]


def tier_namespace(fingerprint: bytes, mac_key: bytes | None) -> str:
    """The name a disk or Redis tier keeps the pages of layout `fingerprint` under: its 32 hex characters,
    then ``-`` and `key_id` for pages signed with `mac_key`. Engines whose layout or key differ (or that
    sign and do not) never name the same page, so none of them reads, refuses or writes another's."""
    if len(fingerprint) != 16:
        raise ValueError(f"fingerprint of {len(fingerprint)} bytes (must be 16)")
    return fingerprint.hex() if mac_key is None else f"{fingerprint.hex()}-{key_id(mac_key)}"


@dataclass(frozen=True)
class PageHeader:
    """The decoded fields of a stored page's header."""

    version: int
    hash_algo: int
    checksum_algo: int
    fingerprint: bytes
    key: bytes
    payload_length: int
    tag: bytes
    signed_part: bytes  # the header bytes an HMAC covers

    @property
    def checksum(self) -> int:
        """The payload checksum (integrity algorithms crc32 and xxh3_64)."""
        return int.from_bytes(self.tag[:8], "little")


def mac(mac_key: bytes, signed_part: bytes, payload: Any) -> bytes:
    """HMAC-SHA256 of a header's signed part followed by the payload (or its parts, in order)."""
    h = hmac.new(mac_key, signed_part, hashlib.sha256)
    for part in payload if isinstance(payload, list | tuple) else (payload,):
        h.update(part)
    return h.digest()


def encode_header(key: bytes, payload: Any, fingerprint: bytes, hash_algo: str, mac_key: bytes | None = None) -> bytes:
    """The header of `payload` (bytes-like, or a list / tuple of parts) stored under `key`: checksummed,
    or signed with `mac_key`."""
    if len(key) > 32 or len(fingerprint) != 16:
        raise ValueError(f"key of {len(key)} bytes (max 32) or fingerprint of {len(fingerprint)} (must be 16)")
    length = payload_nbytes(payload)
    algo = DEFAULT_CHECKSUM if mac_key is None else HMAC_SHA256
    fields = (MAGIC, VERSION, HASH_ALGO_IDS[hash_algo], algo, len(key), fingerprint, key, length)
    if mac_key is None:
        return _HEADER.pack(*fields, checksum(payload).to_bytes(8, "little"))
    signed = _HEADER.pack(*fields, b"")[:_SIGNED]
    return _HEADER.pack(*fields, mac(mac_key, signed, payload))


def seal(page: memoryview, key: bytes, fingerprint: bytes, hash_algo: str, mac_key: bytes | None = None) -> None:
    """Write the header of a framed page in place: `page` is one writable byte view of `HEADER_SIZE`
    bytes of room followed by the payload; its first `HEADER_SIZE` bytes become `encode_header` of the
    rest, so `page` is then the stored page byte for byte (one buffer a tier can send or write as is)."""
    page[:HEADER_SIZE] = encode_header(key, page[HEADER_SIZE:], fingerprint, hash_algo, mac_key)


def decode_header(raw: bytes | memoryview) -> PageHeader | None:
    """The header at the start of `raw`, or None when it is not one (short, or wrong magic)."""
    if len(raw) < HEADER_SIZE:
        return None
    magic, version, algo, check, key_len, fingerprint, key, length, tag = _HEADER.unpack_from(raw)
    if magic != MAGIC or key_len > 32:
        return None
    signed = bytes(memoryview(raw)[:_SIGNED])
    return PageHeader(version, algo, check, fingerprint, bytes(key[:key_len]), length, tag, signed)


def _check_fields(header: PageHeader | None, key: bytes, fingerprint: bytes, hash_algo: str) -> str | None:
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
    return None


def check_header(
    header: PageHeader | None, key: bytes, fingerprint: bytes, hash_algo: str, row_bytes: int,
    mac_key: bytes | None = None, stored_bytes: int | None = None,
) -> str | None:  # fmt: skip
    """None when `header` may be the valid page `key` of this layout: every field `check_page` checks
    but the payload's tag (magic, version, hash algorithm, fingerprint, key, payload length, and that
    the page is signed exactly when `mac_key` is given); with `stored_bytes` (the stored page's size,
    header included), that it is not truncated nor padded. Otherwise why the page is refused. Reads
    no payload: a page that passes may still fail `check_page`."""
    reason = _check_fields(header, key, fingerprint, hash_algo)
    if reason is not None or header is None:
        return reason
    if header.payload_length != row_bytes:
        return f"header says a payload of {header.payload_length} bytes, expected {row_bytes}"
    if stored_bytes is not None and stored_bytes != HEADER_SIZE + row_bytes:
        return f"stored page of {stored_bytes} bytes, expected {HEADER_SIZE + row_bytes} (truncated or padded)"
    signed = header.checksum_algo == HMAC_SHA256
    if mac_key is not None and not signed:
        return "the page is not signed and this tier requires an HMAC (tier_hmac_key)"
    if mac_key is None and signed:
        return "the page is signed (HMAC) and this reader has no tier_hmac_key to check it"
    return None


def check_page(
    header: PageHeader | None, payload: Any, key: bytes, fingerprint: bytes, hash_algo: str, row_bytes: int,
    mac_key: bytes | None = None,
) -> str | None:  # fmt: skip
    """None when `payload` (bytes-like, or a list / tuple of parts) is the valid page `key` of this
    layout (signed with `mac_key` when one is given); otherwise why it is refused."""
    reason = _check_fields(header, key, fingerprint, hash_algo)
    if reason is not None or header is None:
        return reason
    nbytes = payload_nbytes(payload)
    if header.payload_length != row_bytes or nbytes != row_bytes:
        return f"payload of {nbytes} bytes (header says {header.payload_length}), expected {row_bytes}"
    if mac_key is not None or header.checksum_algo == HMAC_SHA256:
        return _check_mac(header, payload, mac_key)
    try:
        ok = checksum(payload, header.checksum_algo) == header.checksum
    except ValueError as exc:
        return str(exc)
    return None if ok else "checksum mismatch"


def _check_mac(header: PageHeader, payload: Any, mac_key: bytes | None) -> str | None:
    if mac_key is None:
        return "the page is signed (HMAC) and this reader has no tier_hmac_key to check it"
    if header.checksum_algo != HMAC_SHA256:
        return "the page is not signed and this tier requires an HMAC (tier_hmac_key)"
    if not hmac.compare_digest(mac(mac_key, header.signed_part, payload), header.tag):
        return "HMAC mismatch (forged, corrupted, or signed with another key)"
    return None
