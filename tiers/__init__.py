"""kvtier.tiers."""
