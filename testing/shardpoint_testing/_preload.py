"""Imported once by the launcher's fork server (``launch.PRELOAD``), so ranks forked from it
start with these loaded instead of importing them each: DTensor and the device mesh (sympy),
``torch._dynamo`` (``DTensor.from_local`` imports it), DCP and Megatron-core's
``dist_checkpointing``: about 3 CPU-seconds per rank for DTensor, 2 more for Megatron.
The peers are optional (skipped when absent); their import-time warnings are silenced here
once instead of printed by every rank."""

import importlib
import importlib.util
import warnings

import torch.distributed.device_mesh  # noqa: F401
import torch.distributed.tensor  # noqa: F401
import torch._dynamo  # noqa: F401

OPTIONAL = ("torch.distributed.checkpoint", "megatron.core.dist_checkpointing")

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    for _name in OPTIONAL:
        if importlib.util.find_spec(_name.split(".")[0]) is not None:
            try:
                importlib.import_module(_name)
            except ImportError:
                pass
