"""pagedkv.integrations: pagedkv's tiers behind other inference engines' cache interfaces (loaded lazily)."""
