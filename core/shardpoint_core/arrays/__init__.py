"""Zarr v3 arrays over a byte store: the chunk codec, regions, shard indexes, the spec's
reader checks, and the local fast paths (``pwritev``/``preadv``) behind the store."""
