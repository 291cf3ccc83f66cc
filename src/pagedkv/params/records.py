"""Containers shared by the symbolic and the runtime KV cache inputs.

Both are trees: a leaf *record* holds one device's fields, a *sequence*
lists records (replica-major over devices), and a *map* names sub-trees
(one per cache of a multi-cache model). `flatten()` walks them in order and
yields the fields that are present, so symbolic and runtime inputs line up
position by position.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import fields
from typing import Any, Generic, TypeVar

T = TypeVar("T")

__all__ = ["InputTree", "RecordMixin", "TreeMapMixin"]


class InputTree(Generic[T]):
    """A sequence of per-device records (or of sub-trees)."""

    def __init__(self, inputs: Sequence[InputTree[T]] = ()) -> None:
        self._inputs = list(inputs)

    @property
    def inputs(self) -> list[Any]:
        """The members: per-device records, or sub-trees."""
        return self._inputs

    def flatten(self) -> list[T]:
        """Every field of every record, in order; absent (None) fields are skipped."""
        return [item for member in self.inputs for item in member.flatten()]

    def __iter__(self) -> Iterator[T]:
        return iter(self.flatten())

    def __len__(self) -> int:
        return len(self.flatten())


class RecordMixin:
    """Makes a dataclass an `InputTree` leaf: it is its own only member."""

    @property
    def inputs(self) -> list[Any]:
        return [self]

    def flatten(self) -> list[Any]:
        values = (getattr(self, f.name) for f in fields(self))  # type: ignore[arg-type]
        return [v for v in values if v is not None]


class TreeMapMixin:
    """Makes an `InputTree` of named children; members are the children's members, in dict order."""

    children: dict[str, Any]

    def _init_children(self, children: Mapping[str, Any]) -> list[Any]:
        self.children = dict(children)
        return [m for child in self.children.values() for m in child.inputs]
