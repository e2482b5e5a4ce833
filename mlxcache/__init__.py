"""mlxcache: radix (prefix) caching and batched decode for unmodified mlx-lm models."""
