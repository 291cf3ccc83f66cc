"""Decoding vLLM's KV event messages for the router (`pagedkv.observability.kv_events` writes them).

A batch payload is msgpack ``[ts, [event, ...], data_parallel_rank]``. Since vLLM PR #42892 each
event is a map tagged ``"type"`` and read by field name here; older publishers (msgspec
``array_like`` events) send ``["BlockStored", block_hashes, parent, token_ids, block_size, lora_id,
medium, ...]``, ``["BlockRemoved", block_hashes, medium, ...]``, ``["AllBlocksCleared"]``, read by
position. Fields the router does not use (token ids, LoRA, locality) are skipped. msgspec is
imported on first use (``pip install 'pagedkv[router]'``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["CLEARED", "REMOVED", "STORED", "WireBatch", "WireEvent", "decode_payload", "normalize_medium"]

STORED, REMOVED, CLEARED = "BlockStored", "BlockRemoved", "AllBlocksCleared"
_decoder: Any = None


@dataclass(frozen=True)
class WireEvent:
    """One event: `kind` (STORED / REMOVED / CLEARED), its hashes as sent, medium and KV group."""

    kind: str
    block_hashes: tuple[bytes | int, ...] = ()
    medium: str = "GPU"
    group_idx: int = 0


@dataclass(frozen=True)
class WireBatch:
    """One decoded batch."""

    ts: float
    events: tuple[WireEvent, ...]
    data_parallel_rank: int = 0


def normalize_medium(medium: object) -> str:
    """Upper-case medium name; None (vLLM's GPU pool before it named one) reads as "GPU"."""
    return "GPU" if medium is None else str(medium).upper()


def _hashes(value: object) -> tuple[bytes | int, ...]:
    if not isinstance(value, list | tuple) or not all(isinstance(h, int | bytes) for h in value):
        raise ValueError(f"block_hashes={value!r} must be a list of ints or bytes")
    return tuple(value)


def _group(value: object) -> int:
    if value is None:
        return 0
    if type(value) is not int:
        raise ValueError(f"group_idx={value!r} must be an int")
    return value


def _event(raw: object) -> WireEvent:
    if isinstance(raw, dict):
        kind = raw.get("type")
        if kind == STORED or kind == REMOVED:
            return WireEvent(kind, _hashes(raw.get("block_hashes")), normalize_medium(raw.get("medium")),
                             _group(raw.get("group_idx")))  # fmt: skip
        if kind == CLEARED:
            return WireEvent(CLEARED)
    elif isinstance(raw, list | tuple) and raw:  # msgspec array_like: the tag first, fields by position
        kind = raw[0]
        if kind == STORED and len(raw) >= 5:  # hashes, parent, token_ids, block_size, lora_id, medium, ...
            group = raw[9] if len(raw) > 9 and isinstance(raw[9], int) else 0
            return WireEvent(STORED, _hashes(raw[1]), normalize_medium(raw[6] if len(raw) > 6 else None), group)
        if kind == REMOVED and len(raw) >= 2:
            return WireEvent(REMOVED, _hashes(raw[1]), normalize_medium(raw[2] if len(raw) > 2 else None),
                             _group(raw[3]) if len(raw) > 3 else 0)  # fmt: skip
        if kind == CLEARED:
            return WireEvent(CLEARED)
    raise ValueError(f"not a KV event: {raw!r}"[:200])


def decode_payload(payload: bytes) -> WireBatch:
    """One message's payload as a `WireBatch`. Raises ValueError for anything that is not a KV event
    batch (bad msgpack, wrong shape, unknown event); no side effects."""
    global _decoder
    if _decoder is None:
        try:
            import msgspec.msgpack
        except ImportError as exc:
            raise ImportError("the KV-aware router needs msgspec: pip install 'pagedkv[router]'") from exc
        _decoder = msgspec.msgpack.Decoder()
    try:
        data = _decoder.decode(payload)
    except Exception as exc:  # msgspec.DecodeError and friends
        raise ValueError(f"payload is not msgpack: {exc}") from None
    if not isinstance(data, list) or len(data) not in (2, 3) or not isinstance(data[1], list):
        raise ValueError("payload is not a KVEventBatch: expected [ts, [events], data_parallel_rank]")
    if not isinstance(data[0], int | float):
        raise ValueError(f"batch ts={data[0]!r} must be a number")
    rank = data[2] if len(data) == 3 and isinstance(data[2], int) else 0
    return WireBatch(float(data[0]), tuple(_event(e) for e in data[1]), rank)
