"""``from shardpoint.dcp import ShardpointWriter, ShardpointReader``: shardpoint as storage for
``torch.distributed.checkpoint`` (see :mod:`shardpoint.integrations.dcp`). A facade above the
layers: nothing inside the package imports it."""
from shardpoint.integrations.dcp import ShardpointReader, ShardpointWriter

__all__ = ["ShardpointReader", "ShardpointWriter"]
