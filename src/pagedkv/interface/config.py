"""`KVCacheConfig`: layers grouped by attention type, sharing one pool of page ids.

`get_kv_cache_config` does what vLLM's hybrid allocator does. Layers with
the same token slots (same kind, window, chunk) form a type; every type is
split into groups of the same number of layers (`group_size`, the smallest
type's layer count, or the largest when it is below 1.5x the smallest), so
that a page of any group holds `group_size` layers. Page sizes are unified
by padding. One backing tensor holds `group_size` layer slots per page id;
slot j of every group aliases the same bytes, which is safe because a page
id belongs to one group at a time. Layout per page id::

    [ slot 0: layer j=0 of whichever group owns the page | slot 1 | ... | slot group_size-1 ]
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pagedkv.specs import AttentionSpec, KVCacheSpec, MambaSpec, UniformTypeKVCacheSpecs, _slot_key

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = [
    "KVCacheLayout", "KVCacheTensor", "KVCacheGroupSpec", "KVCacheConfig", "get_kv_cache_config",
    "num_states_for", "compute_layer_kv_cache_shape_bytes", "reshape_kv_cache", "group_layer_specs",
    "unify_state_block_size",
]  # fmt: skip


class KVCacheLayout(enum.Enum):
    """Order of the dims of a group's logical ``[L, B, H, N, C]`` cache in memory (outermost first).

    L layer slot, B block (page), H head, N token state, C bytes of one state of one head.
    pagedkv's own page buffers are block-outermost (BLNHC, with K and V split outside L).
    """

    LBHNC = "LBHNC"
    LBNHC = "LBNHC"
    LHBNC = "LHBNC"
    BLHNC = "BLHNC"
    BLNHC = "BLNHC"
    BHLNC = "BHLNC"


@dataclass
class KVCacheTensor:
    """One backing allocation of `size` bytes; `shared_by[slot]` lists the layers aliasing that slot
    (each from a different group, whose block-id namespaces never collide)."""

    size: int
    shared_by: list[list[str]] = field(default_factory=list)


@dataclass
class KVCacheGroupSpec:
    """Layers that share one block table: the manager treats them as one layer."""

    layer_names: list[str]
    kv_cache_spec: KVCacheSpec


@dataclass
class KVCacheConfig:
    """The KV cache of a model: `num_blocks` page ids, its groups and its backing tensors."""

    num_blocks: int
    kv_cache_tensors: list[KVCacheTensor]
    kv_cache_groups: list[KVCacheGroupSpec]
    kv_cache_layout: KVCacheLayout = KVCacheLayout.BLNHC

    @property
    def group_size(self) -> int:
        """Layer slots per page id (the largest group)."""
        return max(len(g.layer_names) for g in self.kv_cache_groups)

    @property
    def bytes_per_block(self) -> int:
        """Bytes one page id occupies in the backing tensors."""
        return sum(t.size for t in self.kv_cache_tensors) // max(self.num_blocks, 1)

    def layer_slot(self) -> dict[str, tuple[int, int]]:
        """layer name -> (group index, slot index within the group)."""
        return {
            name: (g, j) for g, group in enumerate(self.kv_cache_groups) for j, name in enumerate(group.layer_names)
        }


def num_states_for(spec: KVCacheSpec, block_size: int | None = None) -> int:
    """States one page holds: one per token for attention, one for a recurrent state (`MambaSpec`)."""
    if isinstance(spec, MambaSpec):
        return 1
    return block_size or spec.block_size


def _state_bytes(spec: KVCacheSpec) -> tuple[int, int]:
    """(heads, bytes of one state of one head), padding spread over the heads."""
    if isinstance(spec, MambaSpec):
        return 1, spec.page_size_bytes
    if not isinstance(spec, AttentionSpec):
        return 1, spec.page_size_bytes // spec.block_size
    heads = spec.num_kv_heads
    return heads, spec.page_size_bytes // (spec.block_size * heads)


def compute_layer_kv_cache_shape_bytes(
    spec: KVCacheSpec, num_blocks: int, block_size: int | None = None
) -> tuple[int, ...]:
    """The logical ``(B, H, N, C)`` shape of one layer slot, with C in bytes."""
    heads, state = _state_bytes(spec)
    return (num_blocks, heads, num_states_for(spec, block_size), state)


def reshape_kv_cache(
    raw: torch.Tensor,
    spec: KVCacheSpec,
    num_blocks: int,
    num_layer_slots: int,
    layout: KVCacheLayout,
    block_size: int | None = None,
) -> list[torch.Tensor]:
    """View a flat int8/uint8 buffer as one ``[B, H, N, C]`` tensor per layer slot, in `spec.dtype`.

    C becomes ``bytes / itemsize`` elements. Views share `raw`'s storage.
    """
    import torch

    b, h, n, c = compute_layer_kv_cache_shape_bytes(spec, num_blocks, block_size)
    sizes = {"L": num_layer_slots, "B": b, "H": h, "N": n, "C": c}
    order = layout.value
    physical = raw.view(torch.uint8)[: math.prod(sizes.values())].view(*(sizes[d] for d in order))
    logical = physical.permute(*(order.index(d) for d in "LBHNC"))  # [L, B, H, N, C]
    dtype = spec.dtype.to_torch() if isinstance(spec, AttentionSpec) else torch.uint8
    return [logical[slot].view(dtype) for slot in range(num_layer_slots)]


def group_layer_specs(specs: dict[str, KVCacheSpec], *, by_shape: bool = False) -> list[tuple[list[str], KVCacheSpec]]:
    """Layers grouped as `get_kv_cache_config` groups them: (layer names, merged spec) per group.

    With `by_shape`, layers of one type but different K/V shapes (heads, head size, dtype) are different
    types, so every group has one page shape (pagedkv's own buffers: one `KVCacheParams` per group).
    """
    return _group_layers(specs, by_shape=by_shape)


def _shape_key(spec: KVCacheSpec) -> tuple[Any, ...]:
    if not isinstance(spec, AttentionSpec):
        return ()
    return (spec.num_kv_heads, spec.head_size, spec.dtype)


def _group_layers(specs: dict[str, KVCacheSpec], by_shape: bool = False) -> list[tuple[list[str], KVCacheSpec]]:
    by_type: dict[tuple[Any, ...], list[str]] = defaultdict(list)
    for name, spec in specs.items():
        by_type[_slot_key(spec) + (_shape_key(spec) if by_shape else ())].append(name)
    counts = [len(v) for v in by_type.values()]
    group_size = max(counts) if max(counts) < 1.5 * min(counts) else min(counts)
    groups = []
    for names in by_type.values():
        n_groups = math.ceil(len(names) / group_size)
        for i in range(n_groups):
            members = names[i::n_groups]
            groups.append((members, _merge([specs[m] for m in members])))
    return groups


def _merge(specs: list[KVCacheSpec]) -> KVCacheSpec:
    if all(s == specs[0] for s in specs):
        return specs[0]
    try:
        return type(specs[0]).merge(specs)
    except ValueError:
        uniform = UniformTypeKVCacheSpecs.from_specs({str(i): s for i, s in enumerate(specs)})
        if uniform is None:
            raise
        return uniform


def unify_state_block_size(specs_by_layer: dict[str, KVCacheSpec]) -> dict[str, KVCacheSpec]:
    """The specs with one page size for attention and state layers, as vLLM's hybrid allocator makes it.

    A state slot (`MambaSpec`) is one page of its group, so one pool serves both only when an
    attention page holds at least one layer's state. With A the attention `block_size` and
    ``p`` the largest attention layer's bytes per token, the attention block becomes
    ``A * ceil(state_bytes / (A * p))`` tokens (unchanged when the state already fits), and every
    state spec takes that `block_size` too. Without state layers the specs are returned as they are.
    Raises ValueError when the attention layers' block sizes differ.
    """
    states = {n: s for n, s in specs_by_layer.items() if isinstance(s, MambaSpec)}
    if not states:
        return dict(specs_by_layer)
    others = {n: s for n, s in specs_by_layer.items() if n not in states}
    sizes = {s.block_size for s in others.values()}
    if len(sizes) > 1:
        raise ValueError(f"all attention layers must have one block_size, got {sorted(sizes)}")
    state_bytes = max(max(s.page_size_bytes, s.shard_bytes()) for s in states.values())  # (+ alignment bytes)
    if not others:
        block = next(iter(states.values())).block_size
    else:
        base = sizes.pop()
        per_token = max(-(-s.page_size_bytes // s.block_size) for s in others.values())
        block = base * max(1, -(-state_bytes // (base * per_token)))
    return {n: (s if s.block_size == block else s.copy_with_new_block_size(block)) for n, s in specs_by_layer.items()}


def get_kv_cache_config(specs_by_layer: dict[str, KVCacheSpec], available_memory_bytes: int) -> KVCacheConfig:
    """Group layers, unify page sizes, and size one shared pool for `available_memory_bytes`.

    Every attention spec must have the same `block_size` (tokens per page). With state layers
    (`MambaSpec`), the attention block grows until a page holds a layer's state
    (`unify_state_block_size`, vLLM's rule). Smaller layer pages (attention or state) are
    padded to the largest. Raises ValueError when nothing fits.
    """
    if not specs_by_layer:
        raise ValueError("specs_by_layer is empty")
    specs_by_layer = unify_state_block_size(specs_by_layer)
    block_sizes = {s.block_size for s in specs_by_layer.values()}
    if len(block_sizes) != 1:
        raise ValueError(f"all layers must have one block_size, got {sorted(block_sizes)}")
    groups = _group_layers(specs_by_layer)
    page = max(spec.page_size_bytes for _, spec in groups)
    padded = [(names, _pad(spec, page)) for names, spec in groups]
    group_size = max(len(names) for names, _ in padded)
    num_blocks = available_memory_bytes // (page * group_size)
    if num_blocks < 1:
        raise ValueError(f"available_memory_bytes={available_memory_bytes} holds no block of {page * group_size} bytes")
    shared_by = [[names[j] for names, _ in padded if j < len(names)] for j in range(group_size)]
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[KVCacheTensor(size=num_blocks * page * group_size, shared_by=shared_by)],
        kv_cache_groups=[KVCacheGroupSpec(list(names), spec) for names, spec in padded],
    )


def _pad(spec: KVCacheSpec, page: int) -> KVCacheSpec:
    if spec.page_size_bytes == page:
        return spec
    if not isinstance(spec, AttentionSpec | MambaSpec):
        raise ValueError(f"cannot pad {type(spec).__name__} pages to {page} bytes")
    return dataclasses.replace(spec, page_size_padded=page)
