"""Model implementations that run on hybridattn's backends."""

from hybridattn.models import kimi_linear

__all__ = ["kimi_linear"]
