"""shardpoint_core: the framework-neutral core of shardpoint, importing neither torch nor JAX.

A ladder, each rung a folder that imports only the rungs below it (checked by import-linter,
``pyproject.toml``): ``format`` (errors, keys, dtypes, values, the state tree, coverage, the
manifest codec, the array layout: pure) < ``stores`` (byte stores, :class:`~.stores.location.
Location`, the POSIX syscalls) < ``arrays`` (Zarr v3 arrays over a store) | ``commit`` (the
committers, leftovers, steps, recovery) < ``transactions`` (writing and reading a checkpoint)
< ``verify``. The torch front end (``shardpoint``) and the JAX front end (``shardpoint_jax``)
build on it.
"""

__version__ = "0.1.0"
