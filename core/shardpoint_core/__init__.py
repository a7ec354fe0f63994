"""shardpoint_core: the framework-neutral core of shardpoint, importing neither torch nor JAX.

Layers, bottom to top: errors, keys, dtypes and values (the spec's vocabulary); the manifest
codec; the Zarr array layer (``zarr/``); stores and the commit protocol (``store/``,
``commit/``); ``verify`` and ``recovery`` on top. The torch front end (``shardpoint``) and the
JAX front end (``shardpoint_jax``) build on it.
"""
__version__ = "0.1.0"
