"""What a checkpoint manager decides, as plain objects: step names and retention.

Both managers (``shardpoint.CheckpointManager`` and ``shardpoint_jax.CheckpointManager``)
name steps and choose what to keep through this module, so one root written by either is
read and pruned alike. Retention policies are small frozen objects that compose:

    keep = AnyOf(LatestN(3), EveryNSteps(1000), BestN(2, "loss", "min"))
    keep.keep([1, 2, ...], metrics_of)      # -> the set of steps to keep

``metrics_of(step)`` returns the metrics dict saved with a step; policies that do not rank by
a metric never call it. :func:`retained` adds the rule every manager keeps on top of any
policy: the newest committed step is never deleted.
"""

from __future__ import annotations

import math
import operator
import re
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol, Sequence, runtime_checkable

from shardpoint_core.format.errors import InvalidKeyError, InvalidOptionError

MetricsOf = Callable[[int], dict[str, Any]]
_STEP = re.compile(r"step_(\d+)\Z")


# ---------------------------------------------------------------------------- step names
def step_number(step: Any) -> int:
    """``step`` as an int >= 0, or InvalidKeyError (a bool or a negative number is no step:
    ``step_-0000001`` would never be listed)."""
    try:
        n = operator.index(step)
    except TypeError:
        n = -1
    if n < 0 or isinstance(step, bool):
        raise InvalidKeyError(
            f"step {step!r} is not a step number: steps are ints >= 0 (the directory is step_%08d)"
        )
    return int(n)


def step_name(step: Any) -> str:
    """The directory name of ``step``: ``step_00000042`` (names sort by step up to 10^8)."""
    return f"step_{step_number(step):08d}"


def parse_step(name: str) -> Optional[int]:
    """The step a directory name stands for, or None for any other name (a name the
    managers did not write, such as ``step_7``, is never counted, kept or removed)."""
    m = _STEP.match(name)
    if m is None:
        return None
    n = int(m.group(1))
    # only the name step_name writes: 'step_7' or 'step_000000007' are someone else's
    return n if step_name(n) == name else None


# ---------------------------------------------------------------------------- retention
@runtime_checkable
class Retention(Protocol):
    """Chooses the steps to keep among committed ``steps`` (pure: no I/O but metrics_of)."""

    def keep(self, steps: Sequence[int], metrics_of: MetricsOf) -> set[Any]: ...


def _positive(name: str, n: Any) -> int:
    if type(n) is not int or n < 1:
        raise InvalidOptionError(f"{name} must be a positive int, got {n!r}")
    return n


@dataclass(frozen=True)
class KeepAll:
    """Keep every step (a manager without retention)."""

    def keep(self, steps: Sequence[int], metrics_of: MetricsOf) -> set[Any]:
        return set(steps)


@dataclass(frozen=True)
class LatestN:
    """Keep the ``n`` newest steps."""

    n: int

    def __post_init__(self) -> None:
        _positive("LatestN(n) / max_to_keep", self.n)

    def keep(self, steps: Sequence[int], metrics_of: MetricsOf) -> set[Any]:
        return set(sorted(steps)[-self.n :])


@dataclass(frozen=True)
class EveryNSteps:
    """Keep every step divisible by ``n`` (milestones)."""

    n: int

    def __post_init__(self) -> None:
        _positive("EveryNSteps(n) / keep_every", self.n)

    def keep(self, steps: Sequence[int], metrics_of: MetricsOf) -> set[Any]:
        return {s for s in steps if s % self.n == 0}


@dataclass(frozen=True)
class BestN:
    """Keep the ``n`` best steps by the finite number ``metric`` saved with them (``mode``
    'min' or 'max'; newer first on ties). Steps without that metric are not ranked."""

    n: int
    metric: str
    mode: str = "min"

    def __post_init__(self) -> None:
        _positive("BestN(n) / keep_best", self.n)
        check_metric(self.metric, self.mode)

    def keep(self, steps: Sequence[int], metrics_of: MetricsOf) -> set[Any]:
        return set(ranked(steps, metrics_of, self.metric, self.mode)[: self.n])


@dataclass(frozen=True)
class AnyOf:
    """Keep a step when any of ``policies`` keeps it."""

    policies: tuple[Any, ...]

    def __init__(self, *policies: Retention) -> None:
        for p in policies:
            if not isinstance(p, Retention):
                raise InvalidOptionError(f"AnyOf takes retention policies, got {p!r}")
        object.__setattr__(self, "policies", tuple(policies))

    def keep(self, steps: Sequence[int], metrics_of: MetricsOf) -> set[Any]:
        out: set[Any] = set()
        for p in self.policies:
            out |= p.keep(steps, metrics_of)
        return out


def check_metric(metric: Any, mode: Any) -> None:
    """InvalidOptionError unless ``metric`` is a str and ``mode`` 'min' or 'max'."""
    if not isinstance(metric, str):
        raise InvalidOptionError(f"best_metric must be a str (a metric name), got {metric!r}")
    if mode not in ("min", "max"):
        raise InvalidOptionError(f"best_mode must be 'min' or 'max', got {mode!r}")


def ranked(steps: Sequence[int], metrics_of: MetricsOf, metric: str, mode: str) -> list[Any]:
    """Steps carrying a finite number ``metric``, best first (newer first on ties)."""
    scored = []
    for s in steps:
        v = metrics_of(s).get(metric)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            scored.append((v if mode == "min" else -v, -s))
    return [-s for _, s in sorted(scored)]


def retained(policy: Retention, steps: Sequence[int], metrics_of: MetricsOf) -> set[Any]:
    """The steps ``policy`` keeps, plus the newest one, which is never deleted."""
    if not steps:
        return set()
    return policy.keep(steps, metrics_of) | {max(steps)}


def policy_from_options(
    max_to_keep: Optional[int] = None,
    keep_every: Optional[int] = None,
    best_metric: Optional[str] = None,
    best_mode: str = "min",
    keep_best: Optional[int] = None,
) -> Retention:
    """The policy the managers' keyword options spell: the ``max_to_keep`` newest (None:
    all), every multiple of ``keep_every``, and the ``keep_best`` best by ``best_metric``.
    ``best_metric`` alone ranks steps for ``best_step()`` and keeps nothing extra: how many
    best steps to keep is ``keep_best``, never an implicit 1."""
    for name, v in (
        ("max_to_keep", max_to_keep),
        ("keep_every", keep_every),
        ("keep_best", keep_best),
    ):
        if v is not None and (type(v) is not int or v < 1):
            raise InvalidOptionError(f"{name} must be a positive int or None, got {v!r}")
    check_metric("" if best_metric is None else best_metric, best_mode)
    if keep_best is not None and best_metric is None:
        raise InvalidOptionError("keep_best needs best_metric (the metric name to rank steps by)")
    parts: list[Any] = [KeepAll() if max_to_keep is None else LatestN(max_to_keep)]
    if keep_every is not None:
        parts.append(EveryNSteps(keep_every))
    if keep_best is not None:
        parts.append(BestN(keep_best, best_metric, best_mode))  # type: ignore[arg-type]
    return parts[0] if len(parts) == 1 else AnyOf(*parts)
