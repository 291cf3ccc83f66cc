"""`BlockLayout`: what one vLLM KV block's page holds, its layout fingerprint, and its key.

A stored page (`pagedkv.offload.format`) is one vLLM block of every attention
layer of one tensor-parallel rank, in vLLM's logical order, whatever the
physical `KVCacheLayout` of the engine that wrote it::

    row = [ layer 0: H x N x C bytes | layer 1 | ... | layer L-1 ]     # [L, H, N, C] bytes

where [H, N, C] is vLLM 0.33's per-layer block view ``[num_blocks, H, N, C]``
(`vllm.v1.kv_cache_interface.create_kv_cache_views`): H KV heads of this rank,
N = block_size tokens, C = K then V of one head (``head_size + head_size_v``
elements of the cache dtype; MLA: one latent vector, H = 1).

The key of block i is vLLM's own block hash (`Request.block_hashes`): the hash
of the block's last ``hash_block_size`` chunk, which chains over the whole
prefix (and LoRA, multimodal inputs and ``cache_salt``). Engines with the same
hash function and seed (sha256: ``PYTHONHASHSEED`` unset or equal) therefore
find each other's pages. Pure Python: no vLLM, no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pagedkv.offload.format import layout_fingerprint

__all__ = ["FORMAT_HASH_ALGO", "BlockLayout"]

# vLLM's prefix-caching hash algorithms -> the hash algorithm id of pagedkv's page header
FORMAT_HASH_ALGO = {"sha256": "sha256", "sha256_cbor": "sha256", "xxhash": "xxh3_128", "xxhash_cbor": "xxh3_128"}


@dataclass(frozen=True)
class BlockLayout:
    """One KV-cache group of full-attention (or MLA) layers, as seen by one TP rank.

    Attributes:
        model_id: the model's name in the fingerprint (pages of another model are misses).
        layer_names: the group's layers, in vLLM's order (the order of a row's layer slices).
        spec_kind: vLLM's spec class name (``FullAttentionSpec``, ``MLAAttentionSpec``, ...).
        dtype: the cache dtype's name (``torch.bfloat16``, ``torch.float8_e4m3fn``, ...).
        cache_dtype: vLLM's ``--kv-cache-dtype`` (``auto``, ``fp8``, ...).
        block_size: tokens per block (N).
        hash_block_size: tokens per vLLM block hash (divides `block_size`).
        num_heads: KV heads per block of this rank (H).
        head_bytes: bytes of one token of one head (C: K and V concatenated).
        head_size / head_size_v: K and V head dims (elements).
        tp_size: tensor-parallel degree; each rank's pages have their own fingerprint.
        hash_algo: vLLM's ``prefix_caching_hash_algo``.

    Whether pages are signed, and with which key, is not part of the layout: the tiers keep pages of each
    key in a namespace of its own (`pagedkv.offload.format.tier_namespace`).
    """

    model_id: str
    layer_names: tuple[str, ...]
    spec_kind: str
    dtype: str
    cache_dtype: str
    block_size: int
    hash_block_size: int
    num_heads: int
    head_bytes: int
    head_size: int
    head_size_v: int
    tp_size: int
    hash_algo: str

    def __post_init__(self) -> None:
        if self.hash_algo not in FORMAT_HASH_ALGO:
            raise ValueError(f"prefix_caching_hash_algo={self.hash_algo!r} is not one of {sorted(FORMAT_HASH_ALGO)}")
        if self.hash_block_size < 1 or self.block_size % self.hash_block_size:
            raise ValueError(f"hash_block_size={self.hash_block_size} must divide block_size={self.block_size}")
        if not self.layer_names or min(self.num_heads, self.head_bytes, self.block_size, self.tp_size) < 1:
            raise ValueError(f"empty block layout: {self}")

    @property
    def num_layers(self) -> int:
        return len(self.layer_names)

    @property
    def layer_bytes(self) -> int:
        """Bytes of one layer's block: H x N x C."""
        return self.num_heads * self.block_size * self.head_bytes

    @property
    def row_bytes(self) -> int:
        """Bytes of one stored page (every layer's block of one rank)."""
        return self.num_layers * self.layer_bytes

    @property
    def format_hash_algo(self) -> str:
        """The hash algorithm id written in each page header."""
        return FORMAT_HASH_ALGO[self.hash_algo]

    def describe(self, tp_rank: int) -> list[object]:
        """Every field that decides what a page's bytes mean (the input of the fingerprint)."""
        return [
            "vllm-v1-block", "rows=LHNC", self.spec_kind, self.dtype, self.cache_dtype, self.block_size,
            self.hash_block_size, self.num_heads, self.head_bytes, self.head_size, self.head_size_v, self.layer_names,
            ("tp", self.tp_size, tp_rank), ("hash", self.hash_algo),
        ]  # fmt: skip

    def fingerprint(self, tp_rank: int) -> bytes:
        """16 bytes naming this layout on rank `tp_rank` of `tp_size` (`offload.format.layout_fingerprint`):
        a page of another model, dtype, shape, block size, TP degree or rank is a miss, never loaded."""
        if not 0 <= tp_rank < self.tp_size:
            raise ValueError(f"tp_rank={tp_rank} must be in [0, {self.tp_size})")
        return layout_fingerprint(self.describe(tp_rank), self.model_id)

    def block_keys(self, block_hashes: Sequence[bytes]) -> list[bytes]:
        """The key of each full block of a request: the hash of its last ``hash_block_size`` chunk.
        `block_hashes` is vLLM's ``Request.block_hashes`` (one per chunk, bytes of 8 to 32)."""
        ratio = self.block_size // self.hash_block_size
        keys = list(block_hashes[ratio - 1 :: ratio])
        for key in keys[:1]:
            if not isinstance(key, bytes) or not 0 < len(key) <= 32:
                raise TypeError(f"a vLLM block hash must be 1 to 32 bytes, got {key!r}")
        return keys
