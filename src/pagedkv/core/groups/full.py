"""Full attention and MLA: every page stays while the request runs; a hit is any cached prefix."""

from __future__ import annotations

from pagedkv.core.groups.base import GroupManager

__all__ = ["FullAttentionManager", "MLAAttentionManager"]


class FullAttentionManager(GroupManager):
    """Full attention: the base policy as it is (every token's page, from the first `alloc`)."""


class MLAAttentionManager(FullAttentionManager):
    """MLA: full attention over one latent per token (only the page format differs)."""

    kind = "mla_attention"
