"""Model, optimizer and per-rank training state as shardpoint trees, and back.

Trees are keyed by parameter *name* (fully qualified, as ``model.named_parameters()`` gives
it), never by integer position, so a checkpoint survives a change of parallelism or of
parameter order. Plain modules, FSDP2 (``fully_shard``) and DTensor models all go through
``torch.distributed.checkpoint.state_dict``: their tensors come out as plain tensors or
DTensors that share storage with the model, so ``load(like=...)`` fills the model in place.

Per-rank state (RNG states, a rank's data-loader position) is a :class:`ShardedObject` entry
per rank. **World-size rule**: such entries are restored only when the job resumes with the
world size it saved with (:func:`rank_value` returns None otherwise). Global progress
(iteration, consumed samples) is saved as plain values, identical on every rank, so a job
resuming with another world size re-seeds each rank from ``(seed, iteration, rank)`` and
derives its data position from the consumed samples.

    state = {"model": model_state(model), "optim": optimizer_state(model, opt),
             "iteration": it, "rank": per_rank({"rng": rng_state(), "pos": pos})}
    mgr.save(it, state)
    ...
    out = mgr.load(like={"model": model_state(model), "optim": optimizer_state(model, opt),
                         "iteration": 0})
    set_optimizer_state(model, opt, out["optim"])   # hyper-parameters, param groups
    saved = rank_value(sp.read_metadata(mgr.path(step)), ("rank",))
    if saved: set_rng_state(saved["rng"])
"""

from __future__ import annotations

import random
from typing import Any, Optional, Sequence

import numpy as np
import torch

from shardpoint import api
from shardpoint_core.format import errors
from shardpoint_core.format.keys import encode_key
from shardpoint_core.format.manifest import Manifest
from shardpoint_core.format.statetree import TensorLeaf
from shardpoint.tree.model import ShardedObject, ShardedTensor

COMPILED_PREFIX = "_orig_mod."
LOAD_BATCH_BYTES = 16 << 20  # bytes one load_model step reads at once


def _strip(sd: dict, prefix: Optional[str]) -> dict:
    """``sd`` with the name component ``prefix`` (e.g. ``"_orig_mod."``) dropped everywhere."""
    if not prefix:
        return sd
    return {".".join(c for c in k.split(".") if c + "." != prefix): v for k, v in sd.items()}


# ------------------------------------------------------------------- model and optimizer
def model_state(model: torch.nn.Module, *, strip_prefix: Optional[str] = None) -> dict:
    """``{name: tensor}`` for ``model`` (DTensors for FSDP2/TP models), sharing its storage.
    ``strip_prefix="_orig_mod."`` drops the prefix ``torch.compile`` adds to names."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return _strip(get_model_state_dict(model), strip_prefix)


def set_model_state(model: torch.nn.Module, state: dict, *, strict: bool = True) -> None:
    """Copy a ``{name: tensor}`` tree (as loaded) into ``model``."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(model, state, options=StateDictOptions(strict=strict))


def optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """``{"state": {name: {...}}, "param_groups": [...]}`` keyed by parameter name.

    A fresh optimizer gets its state allocated first (what a ``like`` tree needs): AdamW's
    ``exp_avg``/``exp_avg_sq``, SGD's ``momentum_buffer``, Adam's ``max_exp_avg_sq``...
    """
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer)


def set_optimizer_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict
) -> None:
    """Restore what :func:`optimizer_state` gave (as loaded): moments and param groups."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    set_optimizer_state_dict(model, optimizer, state)


def flattened_shard(
    data: torch.Tensor,
    block_shape: Sequence[int],
    start: int,
    *,
    global_shape: Optional[Sequence[int]] = None,
    global_offset: Optional[Sequence[int]] = None,
    replica_id: Any = 0,
) -> ShardedTensor:
    """A distributed optimizer's shard: ``data`` (1-D) holds elements ``start:start+len``
    of the row-major flattening of the block ``block_shape`` at ``global_offset`` (default:
    the whole tensor) of a tensor of ``global_shape`` (default: the block)."""
    shape = tuple(block_shape)
    return ShardedTensor(
        data,
        tuple(global_shape or shape),
        tuple(global_offset or (0,) * len(shape)),
        local_shape=shape,
        flattened_range=(start, start + data.numel()),
        replica_id=replica_id,
    )


# ------------------------------------------------------------------- per-rank state
def _rank_world(group: Any) -> tuple:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def per_rank(value: Any, *, group: Any = None) -> ShardedObject:
    """``value`` as this rank's entry of a per-rank object (index = rank, count = world)."""
    rank, world = _rank_world(group)
    return ShardedObject(value, rank, world)


def rank_value(manifest: Manifest, path: Sequence[Any], *, group: Any = None) -> Any:
    """This rank's saved entry of the per-rank object at tree ``path``, or None when the
    checkpoint was saved with another world size (see the module's world-size rule)."""
    key = encode_key(tuple(path))
    if key not in manifest.objects:
        raise errors.LayoutMismatchError(
            f"sharded object {key!r} is not in the checkpoint", spec_id="SP-LOAD-1"
        )
    vals = manifest.objects[key]
    rank, world = _rank_world(group)
    return vals[rank] if len(vals) == world else None


def rng_state() -> dict:
    """The RNG states of python, numpy, torch CPU and every CUDA device, as plain values."""
    return {
        "python": random.getstate(),
        "numpy": tuple(np.random.get_state()),
        "torch": torch.get_rng_state(),
        "cuda": list(torch.cuda.get_rng_state_all()) if torch.cuda.is_available() else [],
    }


def set_rng_state(state: dict) -> None:
    """Restore what :func:`rng_state` gave (CUDA states only when the device count matches)."""
    v, internal, gauss = state["python"]
    random.setstate((v, tuple(internal), gauss))
    np.random.set_state(tuple(state["numpy"]))
    torch.set_rng_state(torch.as_tensor(state["torch"], dtype=torch.uint8))
    cuda = state.get("cuda") or []
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all([torch.as_tensor(c, dtype=torch.uint8) for c in cuda])


# ------------------------------------------------------------------- inference loads
def load_model(
    path: str,
    model: torch.nn.Module,
    *,
    key: str = "model",
    strip_prefix: Optional[str] = None,
    group: Any = None,
    report: Optional[api.LoadReport] = None,
) -> torch.nn.Module:
    """Fill ``model`` from the ``key`` subtree of the checkpoint at ``path``; nothing else of
    the checkpoint (optimizer moments...) is read.

    A model built on the ``meta`` device is materialized on CPU straight from the checkpoint
    (``to_empty``, then filled in place: one copy of the weights, never two). Tensors whose
    dtype differs from the checkpoint's (a bf16 checkpoint into an fp32 model) are cast
    through a bounded scratch buffer, never a second full copy. ``strip_prefix="_orig_mod."``
    matches names of a compiled model on either side with those of a plain one.
    """
    if any(t.is_meta for t in list(model.parameters()) + list(model.buffers())):
        model.to_empty(device="cpu")
    m = api.read_metadata(path)
    tree = m.tree
    sub = tree.get(key) if isinstance(tree, dict) else None
    stored = (
        {name: leaf.entry for name, leaf in sub.items() if isinstance(leaf, TensorLeaf)}
        if isinstance(sub, dict)
        else {}
    )
    by_plain = {(_strip({k: 0}, strip_prefix).popitem()[0]): k for k in stored}
    report = report if report is not None else api.LoadReport()
    todo: list = []
    for name, t in model.state_dict().items():
        plain = _strip({name: 0}, strip_prefix).popitem()[0]
        ck = by_plain.get(plain)
        if ck is None:
            raise errors.LayoutMismatchError(
                f"model tensor {name!r} is not in the checkpoint under {key!r} (checkpoint "
                f"names look like {sorted(stored)[:3]}; compiled model? pass "
                f"strip_prefix={COMPILED_PREFIX!r})",
                spec_id="SP-LOAD-1",
            )
        todo.append((ck, t))
    # In batches of bounded size: the reader's chunk buffers and the cast scratch stay small
    # next to the model, whatever its size.
    total, batch, held = 0, [], 0
    for i, (ck, t) in enumerate(todo):
        batch.append((ck, t))
        held += stored[ck].nbytes
        if held < LOAD_BATCH_BYTES and i + 1 < len(todo):
            continue
        like = {
            key: {
                c: (
                    x
                    if str(x.dtype)[6:] == stored[c].dtype
                    else torch.empty(tuple(stored[c].shape), dtype=_torch_dtype(stored[c].dtype))
                )
                for c, x in batch
            }
        }
        rep = api.LoadReport()
        out = api.load(path, like=like, group=group, report=rep)
        for c, x in batch:
            if out[key][c] is not x:
                x.copy_(out[key][c])  # cast into the model's dtype
        total += rep.rank_bytes_read
        batch, held = [], 0
    report.rank_bytes_read = total
    return model


def _torch_dtype(name: str) -> torch.dtype:
    from shardpoint.tree import dtypes

    return dtypes.from_name(name).torch
