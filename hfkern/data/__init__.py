"""Input data: :class:`CachedDataset`, decoded samples cached in memory and on a shared local disk."""

from .cache import CachedDataset

__all__ = ["CachedDataset"]
