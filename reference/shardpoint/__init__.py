"""shardpoint: sharded training checkpoints in a framework-neutral, specified format.

Quick use::

    import shardpoint as sp
    sp.save({"model": model.state_dict(), "step": 10}, "/ckpt/step_10")
    state = sp.load("/ckpt/step_10")                  # whole tree on CPU
    sp.load("/ckpt/step_10", like={"model": model.state_dict()})   # in place, any sharding
    with sp.open("/ckpt/step_10") as ckpt:            # lazy, read-only: one slice of one tensor
        block = ckpt["model/w"][10:20, :4].to_torch()
"""
__version__ = "0.1.0"

from .api import (AsyncSave, LoadOptions, LoadReport, SaveOptions, SaveResult, load,
                  read_metadata, save)
from .errors import (CheckpointExistsError, CheckpointNotFoundError, CorruptCheckpointError,
                     IncompleteCheckpointError, InvalidKeyError, InvalidShardingError,
                     LayoutMismatchError, LoadFailedError, ResourceLimitError, SaveFailedError,
                     ShardpointError, UnsupportedFormatError, UnsupportedValueError,
                     ConversionError, InvalidOptionError, RankLostError)
from .lazy import Checkpoint, TensorView, open  # noqa: A004 - sp.open, like zarr.open
from .manager import CheckpointManager
from .metadata import FORMAT_VERSION, Manifest
from .model import ShardedObject, ShardedPieces, ShardedTensor
from .planner import PlanOptions
from .recovery import RecoveryAction, recover

__all__ = [
    "save", "load", "read_metadata", "open", "Checkpoint", "TensorView", "CheckpointManager",
    "ShardedTensor", "ShardedPieces", "ShardedObject", "SaveOptions", "SaveResult", "AsyncSave",
    "LoadReport", "LoadOptions", "PlanOptions", "Manifest", "FORMAT_VERSION", "ShardpointError",
    "CheckpointNotFoundError", "CheckpointExistsError", "IncompleteCheckpointError",
    "CorruptCheckpointError", "UnsupportedFormatError", "InvalidKeyError",
    "UnsupportedValueError", "InvalidShardingError", "LayoutMismatchError", "SaveFailedError",
    "LoadFailedError", "RankLostError", "ResourceLimitError", "ConversionError",
    "InvalidOptionError",
    "recover", "RecoveryAction",
]
