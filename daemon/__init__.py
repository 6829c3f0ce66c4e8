"""kvtier.daemon."""
