"""The stored page format: header fields, and every reason a page is refused."""

from __future__ import annotations

import hashlib
import hmac
import re
import struct

import pytest

from pagedkv.offload.format import (
    HEADER_SIZE,
    check_page,
    checksum,
    decode_header,
    encode_header,
    key_bytes,
    layout_fingerprint,
)

KEY = bytes(range(32))
FP = layout_fingerprint(["float32", 4, 2, 8, 3, 1], "model-a")
ROW = bytes(range(256)) * 4  # 1024 bytes


def test_header_round_trip() -> None:
    header = encode_header(KEY, ROW, FP, "sha256")
    assert len(header) == HEADER_SIZE == 112 and header[:4] == b"PKVP"
    decoded = decode_header(header)
    assert decoded is not None
    assert (decoded.version, decoded.hash_algo, decoded.key, decoded.fingerprint) == (2, 1, KEY, FP)
    assert (decoded.payload_length, decoded.checksum) == (1024, checksum(ROW, decoded.checksum_algo))
    assert check_page(decoded, ROW, KEY, FP, "sha256", 1024) is None


def test_keys_and_fingerprints() -> None:
    assert key_bytes(b"\x01\x02") == b"\x01\x02"
    assert key_bytes(-2) == b"\xff" * 7 + b"\xfe" and key_bytes(5) == b"\x00" * 7 + b"\x05"
    assert layout_fingerprint(["float32", 4], "a") != layout_fingerprint(["float32", 4], "b")
    assert layout_fingerprint(["float32", 4], "a") != layout_fingerprint(["bfloat16", 4], "a")
    assert len(FP) == 16 and layout_fingerprint(["float32", 4, 2, 8, 3, 1], "model-a") == FP


def _tamper(offset: int, fmt: str, value: object) -> bytes:
    header = bytearray(encode_header(KEY, ROW, FP, "sha256"))
    struct.pack_into(fmt, header, offset, value)
    return bytes(header)


@pytest.mark.parametrize(
    ("header", "payload", "reason"),
    [
        (b"XXXX" + encode_header(KEY, ROW, FP, "sha256")[4:], ROW, "not a pagedkv page"),
        (encode_header(KEY, ROW, FP, "sha256")[:40], ROW, "not a pagedkv page"),
        (_tamper(4, "<H", 1), ROW, "format version 1, this reader knows 2"),
        (encode_header(KEY, ROW, FP, "xxh3_128"), ROW, r"hash algorithm id 3, expected 1 \(sha256\)"),
        (encode_header(KEY, ROW, layout_fingerprint(["bfloat16"]), "sha256"), ROW, "layout fingerprint differs"),
        (encode_header(bytes(32), ROW, FP, "sha256"), ROW, "stored under another content hash"),
        (encode_header(KEY, ROW, FP, "sha256"), ROW[:-1], "payload of 1023 bytes"),
        (encode_header(KEY, ROW, FP, "sha256"), ROW[:-1] + b"\x00", "checksum mismatch"),
        (_tamper(7, "<B", 9), ROW, "unknown checksum algorithm id 9"),
    ],
)
def test_refusals(header: bytes, payload: bytes, reason: str) -> None:
    got = check_page(decode_header(header), payload, KEY, FP, "sha256", 1024)
    assert got is not None
    assert __import__("re").search(reason, got), got


def test_crc32_pages_are_read_too() -> None:
    header = bytearray(encode_header(KEY, ROW, FP, "sha256"))
    struct.pack_into("<B", header, 7, 1)  # checksum algorithm: crc32
    struct.pack_into("<Q", header, 68, checksum(ROW, 1))
    assert check_page(decode_header(bytes(header)), ROW, KEY, FP, "sha256", 1024) is None


MAC_KEY = b"k" * 16
OTHER_KEY = b"z" * 16


def _signed(key: bytes = KEY, payload: bytes = ROW, fp: bytes = FP, mac_key: bytes = MAC_KEY) -> bytes:
    return encode_header(key, payload, fp, "sha256", mac_key)


def test_signed_page_round_trip_and_tag() -> None:
    header = _signed()
    decoded = decode_header(header)
    assert decoded is not None and decoded.checksum_algo == 3 and len(header) == HEADER_SIZE
    # the tag is HMAC-SHA256(key, header[0:68] || payload), computed here with hmac alone
    assert decoded.tag == hmac.new(MAC_KEY, header[:68] + ROW, hashlib.sha256).digest()
    assert check_page(decoded, ROW, KEY, FP, "sha256", 1024, MAC_KEY) is None


def _forged_checksum_page() -> bytes:
    """What a writer without the key can do: a valid header and checksum over a payload of its choice."""
    return encode_header(KEY, bytes(1024), FP, "sha256")


@pytest.mark.parametrize(
    ("header", "payload", "mac_key", "reason"),
    [
        (_forged_checksum_page(), bytes(1024), MAC_KEY, "not signed and this tier requires an HMAC"),
        (_signed(mac_key=OTHER_KEY), ROW, MAC_KEY, "HMAC mismatch"),
        (_signed(), ROW[:-1] + b"\x00", MAC_KEY, "HMAC mismatch"),  # payload swapped under a valid header
        (_signed(payload=bytes(1024)), ROW, MAC_KEY, "HMAC mismatch"),
        (_signed(key=bytes(32)), ROW, MAC_KEY, "stored under another content hash"),  # copied under another key
        (_signed(), ROW, None, "signed \\(HMAC\\) and this reader has no tier_hmac_key"),
    ],
    ids=["unsigned-forgery", "other-key", "flipped-payload", "payload-swap", "moved-key", "keyless-reader"],
)
def test_signed_refusals(header: bytes, payload: bytes, mac_key: bytes | None, reason: str) -> None:
    got = check_page(decode_header(header), payload, KEY, FP, "sha256", 1024, mac_key)
    assert got is not None and re.search(reason, got), got


def test_a_signature_covers_every_header_field() -> None:
    """Re-pointing a signed header at another key, layout or length (and fixing the fields the
    reader compares) still fails: the HMAC covers bytes 0..67 of the header."""
    for offset, fmt, value in [(6, "<B", 2), (12, "<16s", bytes(16)), (28, "<32s", bytes(32)), (60, "<Q", 1023)]:
        header = bytearray(_signed())
        struct.pack_into(fmt, header, offset, value)
        decoded = decode_header(bytes(header))
        assert decoded is not None
        got = check_page(decoded, ROW, decoded.key, decoded.fingerprint, "sha256_64" if offset == 6 else "sha256",
                         decoded.payload_length if offset == 60 else 1024, MAC_KEY)  # fmt: skip
        assert got is not None and ("HMAC mismatch" in got or "payload of" in got), (offset, got)
