"""The stored page format: header fields, and every reason a page is refused."""

from __future__ import annotations

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
    assert len(header) == HEADER_SIZE == 80 and header[:4] == b"PKVP"
    decoded = decode_header(header)
    assert decoded is not None
    assert (decoded.version, decoded.hash_algo, decoded.key, decoded.fingerprint) == (1, 1, KEY, FP)
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
        (_tamper(4, "<H", 2), ROW, "format version 2, this reader knows 1"),
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
