"""What the job may do when workers die: `RecoveryPolicy`, one small config per concern.

`RecoveryPolicy` says which recoveries are allowed (the hierarchy or the restart baseline,
approximations, a strategy allow-list, spares, a recovery budget) and nests one config per
concern: `SnapshotPolicy` (the peer and durable tiers), `MirrorPolicy` (embedding shard
mirrors and partial recovery), `CheckFreeConfig` (approximate rebuilds), `RestartBaseline`
(the baseline's checkpoints) and `Timeouts` (every wait the runtime makes). Each knob has
one home and one spelling: the flat keyword arguments of earlier versions
(``snapshot_every=``, ``mirror_every=``, ``hang_timeout_s=``, ...) are refused, naming their
home (`RENAMED`), the way `parallelism.checks.check_renamed` refuses any config's old keys.
A part is given as its config object or as a mapping of its fields (a TOML table:
``[policies.restart.baseline] checkpoint_every = 20``). Every choice among fixed strings is
a ``Literal`` whose values the constructor checks, naming the allowed ones.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal, get_args

from parallelism.checks import (
    check_bool,
    check_choice,
    check_fraction,
    check_int,
    check_number,
    check_positive_int,
    check_renamed,
)
from recovery.names import Mode, ModeName, Strategy, StrategyName

if TYPE_CHECKING:
    from recovery.strategies.checkfree import CheckFreeConfig
    from recovery.strategies.embedding import EmbeddingPolicy, MirrorPlan

__all__ = [
    "APPROXIMATIONS",
    "MODES",
    "RENAMED",
    "STRATEGY_NAMES",
    "Approximation",
    "MirrorPolicy",
    "NestedWait",
    "RecoveryPolicy",
    "RestartBaseline",
    "SnapshotPolicy",
    "StragglerPolicy",
    "Timeouts",
]

MODES: tuple[ModeName, ...] = get_args(ModeName)
"""``RecoveryPolicy.strategy``: the recovery hierarchy, or the restart baseline (`Mode`)."""
Approximation = Literal["checkfree", "checkfree+"]
"""``RecoveryPolicy.approximate``: CheckFree (intermediate stages), or CheckFree+ (every stage)."""
APPROXIMATIONS: tuple[Approximation | None, ...] = (None, *get_args(Approximation))
STRATEGY_NAMES: tuple[StrategyName, ...] = tuple(
    name for name in get_args(StrategyName) if name != Strategy.RESTART
)
"""The recovery strategies a policy can allow (see docs/DESIGN.md, Recovery hierarchy)."""


def _name(part: type, attr: str) -> str:
    """How a knob is named in errors: its home, e.g. ``snapshots.peer_every``."""
    return f"{_PART_OF[part]}.{attr}"


@dataclass(frozen=True, kw_only=True)
class SnapshotPolicy:
    """Snapshots for rollback: the peer-memory tier and the durable tier.

    Raises:
        ValueError: naming the bad field and value.
    """

    peer_every: int | None = 50
    """Every this many steps each worker keeps a copy of its state in memory and sends one
    to a buddy on another node. None: off."""
    durable_every: int | None = None
    """Durable snapshots (torch.distributed.checkpoint, checksummed) every this many steps.
    None: off. Needed to survive the loss of the driver."""
    dir: str | os.PathLike[str] | None = None
    """Where durable snapshots go (default: ``<run folder>/snapshots``)."""
    keep_durable: int = 2
    """Durable snapshots kept on disk (older ones are deleted)."""

    def __post_init__(self) -> None:
        check_positive_int(_name(SnapshotPolicy, "peer_every"), self.peer_every, optional=True)
        check_positive_int(
            _name(SnapshotPolicy, "durable_every"), self.durable_every, optional=True
        )
        check_positive_int(_name(SnapshotPolicy, "keep_durable"), self.keep_durable)


@dataclass(frozen=True, kw_only=True)
class MirrorPolicy:
    """Embedding tables (`dlrm_spec`): shard mirrors and partial recovery (CPR).

    Raises:
        ValueError: naming the bad field and value.
    """

    embedding: EmbeddingPolicy = "partial"
    """How a lost shard may come back when some of its rows have no current copy.
    ``"partial"`` (CPR): restore those rows stale from the mirror's last full copy while
    the portion of lost samples stays within ``pls_budget``, survivors keep training;
    ``"exact"``: roll back instead."""
    pls_budget: float = 0.05
    """The job's portion of lost samples (PLS) that ``embedding="partial"`` accepts."""
    hot_rows: int = 1024
    """The most frequently used rows of each shard mirrored on the ring neighbour after
    every step."""
    every: int = 10
    """Every row of each shard mirrored after every this many steps (1: every step, which
    makes every restore exact)."""
    hot_every: int = 10
    """The hot rows are chosen again (a top-k of each shard's lookup counters) after every
    this many steps; in between the same rows are mirrored."""

    def __post_init__(self) -> None:
        from recovery.strategies.embedding import EMBEDDING_POLICIES

        check_choice(_name(MirrorPolicy, "embedding"), self.embedding, EMBEDDING_POLICIES)
        check_fraction(_name(MirrorPolicy, "pls_budget"), self.pls_budget)
        check_int(_name(MirrorPolicy, "hot_rows"), self.hot_rows, minimum=0)
        check_positive_int(_name(MirrorPolicy, "every"), self.every)
        check_positive_int(_name(MirrorPolicy, "hot_every"), self.hot_every)

    @property
    def plan(self) -> MirrorPlan:
        """What each embedding shard's owner sends its mirror after every step."""
        from recovery.strategies.embedding import MirrorPlan

        return MirrorPlan(hot_rows=self.hot_rows, mirror_every=self.every, hot_every=self.hot_every)


@dataclass(frozen=True, kw_only=True)
class RestartBaseline:
    """``strategy="restart"`` only: the baseline's checkpoints.

    Raises:
        ValueError: naming the bad field and value.
    """

    checkpoint_every: int = 50
    """Write a checkpoint (torch.distributed.checkpoint) every this many steps."""
    checkpoint_dir: str | os.PathLike[str] | None = None
    """Where checkpoints go (default: the run folder, else a temp folder)."""

    def __post_init__(self) -> None:
        check_positive_int(_name(RestartBaseline, "checkpoint_every"), self.checkpoint_every)


@dataclass(frozen=True, kw_only=True)
class StragglerPolicy:
    """Stragglers: a worker persistently slower than the other replicas of its stage is
    replaced like a dead one (see [Note: stragglers] in recovery/runtime/stragglers.py and
    docs/stragglers.md). ``RecoveryPolicy(stragglers=True)`` turns it on with these
    defaults.

    Raises:
        ValueError: naming the bad field and value.
    """

    factor: float = 2.0
    """A worker is a straggler when its compute time (forward and backward passes, waits on
    peers excluded) over the last ``patience`` steps exceeds this many times that of its
    stage's other replicas (their median in each step, summed). 2: a 3x straggler is far
    above it, while the replicas of a healthy stage, which do the same work, stay within
    a few tens of percent of each other; and a whole machine that slows down slows every
    replica together, which leaves the ratio near 1."""
    patience: int = 20
    """The window, in steps. 20 steps is a fraction of a second to a few seconds of
    training: long enough that a hiccup (a page-cache flush, a burst of another process)
    is a small part of it, short enough that a 3x straggler costs little before it goes."""
    quorum: float = 0.5
    """And the worker was slow (its compute above ``factor`` times the others' median in
    that step) in at least this fraction of the window's steps: a few very slow steps --
    one 100x step lifts a 20-step sum above 2x -- never decide, nor does a worker that a
    neighbour slows now and then. Measured on the 2-core machine: beside a CPU hog, a
    healthy worker of the 4x2 wide MLP came out above 2x over a window while slow in 5-7
    of its 20 steps; a worker stopped 2/3 of the time was slow in 10-13 of 20. Not every
    step: a worker stopped and continued in a duty cycle is slow in most steps, not all
    (some steps' passes fall between two stops)."""
    min_gap_s: float = 0.001
    """And slower by at least this many seconds a step on average: a ratio of two tiny
    times (a stage of 100 us) is noise, not a straggler."""

    def __post_init__(self) -> None:
        check_number(_name(StragglerPolicy, "factor"), self.factor, minimum=1.0)
        if self.factor <= 1.0:
            raise ValueError(
                f"{_name(StragglerPolicy, 'factor')} must be greater than 1, got {self.factor!r}"
            )
        check_positive_int(_name(StragglerPolicy, "patience"), self.patience)
        check_fraction(_name(StragglerPolicy, "quorum"), self.quorum, open_low=True)
        check_number(_name(StragglerPolicy, "min_gap_s"), self.min_gap_s, minimum=0.0)


Guarding = Literal["hang", "save", "control"]
"""The timeouts the controller waits on a worker call with that `Timeouts.within` splits."""


@dataclass(frozen=True, kw_only=True)
class Timeouts:
    """Every wait the runtime makes, by what it waits for (a `timedelta`, or seconds as a
    number: stored as a `timedelta`).

    They form one hierarchy (docs/timeouts.md): ``replace < start`` (both run from the
    moment a worker is asked for, so a worker that cannot be placed is reported before the
    start deadline hides why) and ``hang, transfer < collective`` (the backend's own
    timeout is only a backstop: the controller, which knows which worker is at fault,
    always decides first).

    Raises:
        ValueError: for a wait that is not a positive, finite duration, or two waits out
            of order (naming both).
    """

    start: timedelta = timedelta(seconds=300)
    """Start a worker process and build its stage (a cold start imports torch), once Ray
    has placed it on its node."""
    replace: timedelta = timedelta(seconds=60)
    """Find room for a worker (a replacement, or one of the job's first workers or spares):
    a worker Ray has not placed on its node within this long -- the node is full for
    ``Trainer(worker_resources=...)``, or gone -- ends the job with a ``PlacementFailed``
    (a ``RecoveryError``) naming the workers and why, instead of waiting ``start``."""
    join: timedelta = timedelta(seconds=60)
    """Form a generation's process groups (the rendezvous on the controller's store)."""
    hang: timedelta = timedelta(seconds=120)
    """A step that makes no progress for this long is a hang: the stuck worker is killed
    and replaced. Must exceed the slowest healthy step."""
    transfer: timedelta = timedelta(seconds=300)
    """Move state in a recovery (copies, mirrors, rebuilds) or read out final states."""
    save: timedelta = timedelta(seconds=300)
    """Write or load a checkpoint or a durable snapshot."""
    control: timedelta = timedelta(seconds=60)
    """A survivor's answer to a bookkeeping call (leave the generation, assess a mirror)."""
    collective: timedelta | None = None
    """The process groups' own timeout (c10d's: Gloo's per-operation timeout, NCCL's
    watchdog), a backstop only: it must exceed ``hang`` and ``transfer``, so that a worker
    blocked on a stuck peer is freed by the controller (which kills the culprit and aborts
    the victims' groups), never by its backend. None: twice the longer of the two
    (`backend_timeout`)."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None and f.name == "collective":
                continue
            raw = value.total_seconds() if isinstance(value, timedelta) else value
            check_number(_name(Timeouts, f.name), raw, positive=True)
            object.__setattr__(self, f.name, timedelta(seconds=float(raw)))
        for shorter, longer in _TIMEOUT_ORDER:
            low, high = getattr(self, shorter), getattr(self, longer)
            if high is not None and not low < high:
                raise ValueError(
                    f"{_name(Timeouts, shorter)} ({low.total_seconds():g} s) must be shorter "
                    f"than {_name(Timeouts, longer)} ({high.total_seconds():g} s): "
                    f"{_ORDER_WHY[shorter, longer]} (see docs/timeouts.md)"
                )

    @property
    def backend_timeout(self) -> timedelta:
        """The timeout the process groups are built with: ``collective``, or twice the
        longer of ``hang`` and ``transfer``."""
        if self.collective is not None:
            return self.collective
        return 2 * max(self.hang, self.transfer)

    def within(self, outer: Guarding) -> timedelta:
        """How long a worker may wait for work of its own still in flight (its durable
        writes, the peer exchange) inside a call the controller waits on for ``outer``:
        half of it. The other half is the call's own work (staging the next snapshot), so
        a worker kept waiting by a slow disk answers before the controller takes it for
        lost (docs/timeouts.md)."""
        return getattr(self, outer) / 2

    def nested(self) -> list[NestedWait]:
        """Every wait that runs inside another, with the one that guards it: the
        controller's clocks inside the backend's, each worker call's own waits inside the
        controller's wait on that call. Each inner one is the shorter (docs/timeouts.md)."""
        backend = self.backend_timeout
        return [
            NestedWait("hang", self.hang, "collective", backend),
            NestedWait("transfer", self.transfer, "collective", backend),
            NestedWait("replace", self.replace, "start", self.start),
            *(
                NestedWait(f"{call}: {what}", self.within(outer), outer, getattr(self, outer))
                for call, what, outer in _WORKER_WAITS
            ),
        ]


@dataclass(frozen=True)
class NestedWait:
    """A wait that runs inside another (`Timeouts.nested`)."""

    inner: str
    """What waits: a timeout's name, or ``"<worker call>: <what it waits for>"``."""
    inner_s: timedelta
    outer: str
    """The timeout that guards it."""
    outer_s: timedelta


_WORKER_WAITS: tuple[tuple[str, str, Guarding], ...] = (
    ("durable_write", "its previous durable write", "save"),
    ("flush_snapshots", "its durable writes and peer exchange in flight", "save"),
    ("prepare_recovery", "its durable writes and peer exchange in flight", "control"),
    ("take_snapshot", "its previous peer exchange", "hang"),
)
"""The worker calls that wait for work of the worker's own: (call, what for, the timeout
the controller waits on the call with). Each waits `Timeouts.within` that timeout."""

_TIMEOUT_ORDER = (("replace", "start"), ("hang", "collective"), ("transfer", "collective"))
"""Pairs ``(shorter, longer)`` of `Timeouts` that must be in this order (docs/timeouts.md)."""
_ORDER_WHY = {
    ("replace", "start"): "both run from when a worker is asked for, and a worker Ray "
    "cannot place must be given up on (PlacementFailed, naming the node) before the start "
    "deadline ends the wait without saying why",
    ("hang", "collective"): "the controller must find a hung worker (and free its blocked "
    "peers) before the backend's own timeout fails or, under NCCL, kills those peers",
    ("transfer", "collective"): "a state transfer the controller still waits for must not "
    "be cut short by the backend's own timeout",
}


RENAMED: dict[str, str] = {
    "snapshot_every": "snapshots.peer_every",
    "durable_every": "snapshots.durable_every",
    "snapshot_dir": "snapshots.dir",
    "keep_durable": "snapshots.keep_durable",
    "embedding": "mirrors.embedding",
    "pls_budget": "mirrors.pls_budget",
    "mirror_hot_rows": "mirrors.hot_rows",
    "mirror_every": "mirrors.every",
    "mirror_hot_every": "mirrors.hot_every",
    "checkpoint_every": "baseline.checkpoint_every",
    "checkpoint_dir": "baseline.checkpoint_dir",
    "hang_timeout_s": "timeouts.hang",
    "replace_timeout_s": "timeouts.replace",
    "collective_timeout_s": "timeouts.collective",
}
"""The flat keyword arguments of earlier versions -> the home of each (``part.field``):
`RecoveryPolicy` refuses them, naming the home."""

_PARTS: dict[str, type] = {
    "snapshots": SnapshotPolicy,
    "mirrors": MirrorPolicy,
    "baseline": RestartBaseline,
    "timeouts": Timeouts,
    "stragglers": StragglerPolicy,
}
_PART_OF = {cls: name for name, cls in _PARTS.items()}


def _spell(home: str) -> str:
    """How a home is written in Python: ``snapshots.peer_every`` ->
    ``snapshots=SnapshotPolicy(peer_every=...)``."""
    part, attr = home.split(".")
    return f"{part}={_PARTS[part].__name__}({attr}=...)"


def _part(name: str, cls: type, value: object) -> Any:
    """A part of a policy from its config object or from a mapping of its fields.

    Raises:
        ValueError: for a mapping with a key that is not a field of ``cls`` (naming the
            fields), or a value that is neither.
    """
    if isinstance(value, cls):
        return value
    if isinstance(value, Mapping):
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(str(key) for key in value if key not in known)
        if unknown:
            raise ValueError(
                f"unknown key(s) {unknown} in {name}; a {cls.__name__} has {', '.join(known)}"
            )
        return cls(**value)
    raise ValueError(
        f"{name} must be a {cls.__name__} or a mapping of its fields, got {type(value).__name__}"
    )


def _default_checkfree() -> CheckFreeConfig:
    from recovery.strategies.checkfree import CheckFreeConfig

    return CheckFreeConfig()


@dataclass(frozen=True, kw_only=True, init=False)
class RecoveryPolicy:
    """How failures are handled (see the module docstring).

    Each part (``checkfree``, ``snapshots``, ``mirrors``, ``baseline``, ``timeouts``) is its
    config object or a mapping of its fields: ``RecoveryPolicy(snapshots={"peer_every": 10})``
    is ``RecoveryPolicy(snapshots=SnapshotPolicy(peer_every=10))``.

    Raises:
        ValueError: naming the bad field and value and, for a choice, the allowed values;
            for a keyword argument by its old name (`RENAMED`), naming its home, e.g.
            ``renamed key(s) in RecoveryPolicy: 'snapshot_every' is now
            'snapshots.peer_every' (snapshots=SnapshotPolicy(peer_every=...))``; for an
            unknown keyword argument, or an unknown key in a part given as a mapping,
            naming the known ones.
    """

    strategy: ModeName = Mode.AUTO.value
    """``"auto"``: the recovery hierarchy (rebuild lost workers from live redundancy, roll
    back only when it is exhausted). ``"restart"``: the baseline torchrun and Ray Train
    implement -- tear down every worker, start new ones, load the last checkpoint, redo the
    lost steps."""
    approximate: Approximation | None = None
    """Approximate rebuilds of a stage that lost every replica: ``None`` (never),
    ``"checkfree"`` (intermediate stages, from their neighbours), ``"checkfree+"`` (also the
    first and last stages; trains with swapped routes and (de)embedding replicas)."""
    exact_only: bool = False
    """Never rebuild approximately, whatever ``approximate`` says: exhausted redundancy
    means rollback."""
    allowed: tuple[StrategyName, ...] | None = None
    """Restrict the strategies the planner may use (names in `STRATEGY_NAMES`; any collection
    of them, or one name alone, stored as a tuple); None: all."""
    hot_spares: int = 0
    """Warm spare workers kept ready (torch imported, stage modules built) to replace dead
    ones without a cold start."""
    elastic: bool = False
    """Keep training when a lost worker cannot be replaced at once: with no warm spare
    ready (a cold start would stall every survivor) or no room for a replacement, the job
    shrinks -- it trains on without the lost workers, its complete pipelines computing the
    missing ones' microbatches, so the global batch and every step stay those of the
    failure-free run -- while replacements start as spares in the background; once they are
    ready it grows back (see [Note: elastic shrink] in recovery/runtime/elastic.py). Off:
    the survivors wait for replacements, and a worker that finds no room within
    ``timeouts.replace`` ends the job (`PlacementFailed`)."""
    max_recoveries: int | None = None
    """Give up (``RecoveryError``) after this many recoveries; None: never."""
    comm_retries: int = 3
    """A step that fails with a communication error while every worker is alive is retried
    (after a doubling wait from 0.25 s) at most this many times in a row; then the job gives
    up with a ``RecoveryError`` naming the workers and their errors."""
    fingerprint_every: int | None = None
    """Silent data corruption: every this many steps each worker fingerprints its stage
    state before the commit, and a worker whose fingerprint differs from its stage group's
    majority is rebuilt from it (``replica_vote``), or the job rolls back to the newest
    snapshot whose fingerprints agreed (see [Note: fingerprint vote] in recovery/integrity/fingerprint_vote.py).
    Needs two or more replicas. None or 0: off."""
    checkfree: CheckFreeConfig = field(default_factory=_default_checkfree)
    """The knobs of CheckFree(+) rebuilds (averaging, learning-rate scale, optimizer reset)."""
    snapshots: SnapshotPolicy = field(default_factory=SnapshotPolicy)
    """Snapshots for rollback (peer memory, durable files)."""
    mirrors: MirrorPolicy = field(default_factory=MirrorPolicy)
    """Embedding tables: shard mirrors and partial recovery."""
    baseline: RestartBaseline = field(default_factory=RestartBaseline)
    """The restart baseline's checkpoints."""
    timeouts: Timeouts = field(default_factory=Timeouts)
    """Every wait of the runtime."""
    stragglers: StragglerPolicy | None = None
    """Replace a worker persistently slower than its stage's other replicas, as if it had
    died (`StragglerPolicy`; ``True``: its defaults). None or False: off -- a slow worker
    slows every step of the job. Needs two or more replicas (a stage alone has nothing to
    be compared with: none of its workers is ever found slow)."""

    # A hand-written constructor, only to refuse the old flat names with their home: the
    # generated one would reject them as unexpected, without saying where they went.
    def __init__(self, **kwargs: Any) -> None:
        check_renamed(kwargs, "RecoveryPolicy", RENAMED, spell=_spell)
        fields = dataclasses.fields(RecoveryPolicy)
        unknown = sorted(kwargs.keys() - {f.name for f in fields})
        if unknown:
            raise ValueError(
                f"RecoveryPolicy got unknown keyword arguments {unknown}; its fields are "
                f"{', '.join(f.name for f in fields)}"
            )
        for f in fields:
            if f.name in kwargs:
                value = kwargs[f.name]
            elif f.default is not dataclasses.MISSING:
                value = f.default
            else:
                value = f.default_factory()  # type: ignore[operator]
            object.__setattr__(self, f.name, value)
        self.__post_init__()

    def __post_init__(self) -> None:
        from recovery.strategies.checkfree import CheckFreeConfig

        check_choice("strategy", self.strategy, MODES)
        object.__setattr__(self, "strategy", Mode(self.strategy).value)
        check_choice("approximate", self.approximate, APPROXIMATIONS)
        check_bool("exact_only", self.exact_only)
        if self.allowed is not None:
            # One name alone is that name, never the collection of its letters.
            names = (self.allowed,) if isinstance(self.allowed, str) else self.allowed
            if not isinstance(names, Iterable):
                raise ValueError(
                    f"allowed must be a collection of strategy names or None, got {names!r}"
                )
            names = tuple(names)
            unknown = sorted(str(n) for n in names if n not in STRATEGY_NAMES)
            if unknown:
                raise ValueError(
                    f"unknown strategies {unknown} in allowed; choose from "
                    f"{', '.join(map(repr, STRATEGY_NAMES))}"
                )
            object.__setattr__(self, "allowed", tuple(Strategy(n).value for n in names))
        check_bool("elastic", self.elastic)
        check_int("hot_spares", self.hot_spares, minimum=0)
        check_int("max_recoveries", self.max_recoveries, minimum=0, optional=True)
        check_int("comm_retries", self.comm_retries, minimum=0)
        check_int("fingerprint_every", self.fingerprint_every, minimum=0, optional=True)
        if self.stragglers is True:
            object.__setattr__(self, "stragglers", StragglerPolicy())
        elif self.stragglers is False:
            object.__setattr__(self, "stragglers", None)
        for name, cls in {"checkfree": CheckFreeConfig, **_PARTS}.items():
            if getattr(self, name) is not None or name != "stragglers":
                object.__setattr__(self, name, _part(name, cls, getattr(self, name)))

    def allows(self, strategy: str) -> bool:
        """Whether the planner may use ``strategy``."""
        return self.allowed is None or strategy in self.allowed

    @property
    def swapped_routes(self) -> bool:
        """CheckFree+ trains with the first two and last two stages swapped on odd microbatches."""
        return self.approximate == "checkfree+" and not self.exact_only
