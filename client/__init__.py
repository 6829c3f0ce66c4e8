"""kvtier.client."""
