"""shardpoint: sharded training checkpoints in a framework-neutral, specified format.

Quick use::

    import shardpoint as sp
    sp.save({"model": model.state_dict(), "step": 10}, "/ckpt/step_10")
    state = sp.load("/ckpt/step_10")                  # whole tree on CPU
    sp.load("/ckpt/step_10", like={"model": model.state_dict()})   # in place, any sharding
"""
__version__ = "0.1.0"

from .api import LoadOptions, LoadReport, SaveOptions, SaveResult, load, read_metadata, save
from .errors import (CheckpointExistsError, CheckpointNotFoundError, CorruptCheckpointError,
                     IncompleteCheckpointError, InvalidKeyError, InvalidShardingError,
                     LayoutMismatchError, LoadFailedError, SaveFailedError, ShardpointError,
                     UnsupportedFormatError, UnsupportedValueError)
from .manager import CheckpointManager
from .metadata import FORMAT_VERSION, Manifest
from .model import ShardedObject, ShardedTensor
from .planner import PlanOptions

__all__ = [
    "save", "load", "read_metadata", "CheckpointManager", "ShardedTensor", "ShardedObject", "SaveOptions",
    "SaveResult", "LoadReport", "LoadOptions", "PlanOptions", "Manifest", "FORMAT_VERSION", "ShardpointError",
    "CheckpointNotFoundError", "CheckpointExistsError", "IncompleteCheckpointError",
    "CorruptCheckpointError", "UnsupportedFormatError", "InvalidKeyError",
    "UnsupportedValueError", "InvalidShardingError", "LayoutMismatchError", "SaveFailedError",
    "LoadFailedError",
]
