"""ServerDataStream's constructor arguments, checked and held once (:class:`StreamOptions`),
the checks of its arguments, this process's rank in its job (:func:`find_rank`), and the
reader's settings fixed from them when reading starts (:class:`ReaderSettings`)."""

from __future__ import annotations

import math
import numbers
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from batchq.errors import ConfigError
from batchq.protocol.groups import check_group
from batchq.protocol.ranks import RankLayout

__all__ = ["ReaderSettings", "StreamOptions", "check_stream_options", "find_rank"]


@dataclass(frozen=True)
class StreamOptions:
    """Everything :class:`consumer.ServerDataStream`'s constructor was given (see its
    arguments), checked, held once: the stream, its start and its readers read them
    here, and a pickled stream is made again from :meth:`arguments`.

    ``rank`` and ``world_size`` are this process's, found (:func:`find_rank`) where they
    were not given; ``given_rank`` keeps them as given (they are found again before
    reading starts: :meth:`refound`).
    """

    sources: Sequence[str] | None
    produces_examples: bool
    host: str | None
    port: int | None
    hwm: int
    axis_labels: dict[str, Any] | None
    dtypes: Mapping[str, Any] | None
    queue: str
    url: str | None
    timeout_s: float
    ordered: bool
    writable: bool
    claim_ttl_s: float
    max_frame_bytes: int | None
    on_bad_frame: str
    on_producer_error: str
    stall_s: float
    progress: bool
    transport: str | None
    shm_dir: str | None
    rank: int
    world_size: int
    even_batches: str
    group: str | None  # None: the default group (batchq.protocol.groups)
    max_lag_batches: int | None
    given_rank: tuple[int | None, int | None] = (None, None)

    @classmethod
    def checked(cls, arguments: Mapping[str, Any]) -> StreamOptions:
        """From the constructor's arguments by name: the rank found, every one checked.

        Raises:
            ConfigError: the first invalid argument (:func:`check_stream_options`), or
                a rank that contradicts the process group (:func:`find_rank`).
        """
        given = (arguments["rank"], arguments["world_size"])
        rank, world_size = find_rank(*given)
        ranked = {**arguments, "rank": rank, "world_size": world_size}
        check_stream_options(ranked)
        return cls(**ranked, given_rank=given)

    def refound(self) -> StreamOptions:
        """These options with the rank found again where it was not given (a process
        group initialised after the constructor counts); ``self`` where it is the same."""
        if find_rank(*self.given_rank) == (self.rank, self.world_size):
            return self
        return self.checked(self.arguments())

    def arguments(self) -> dict[str, Any]:
        """The constructor's arguments by name, the rank and world size as given."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "given_rank"}
        out["rank"], out["world_size"] = self.given_rank
        return out

    @property
    def claim_ttl_ms(self) -> int:
        """``claim_ttl_s`` in the scripts' unit."""
        return int(self.claim_ttl_s * 1000)


@dataclass(frozen=True)
class ReaderSettings:
    """The reader's settings, fixed when reading starts (the stream's, at its first epoch).

    Attributes:
        options: the stream's options (the reader reads hwm, the trainer's prefetch
            bound; timeout_s, after which ProducersLost is raised with no producer
            alive, also the bound of a reconnect and of the wait for a replaced key's
            repair; max_frame_bytes, above which frames go to the dead list undecoded;
            on_bad_frame, 'raise' or 'skip'; stall_s, after which without a frame
            dead producers are reaped and shards with a gap handed back).
        writable: writable arrays: frames stored by reference are received into buffers
            of their own (no copy); frames inside the list are copied once (the
            stream's frame preparation says, as set before the first epoch).
        layout: a data-parallel job's split: the ledger holds this rank's local shards.
            None for a single trainer (a layout of world 1 is stored as None).
    """

    options: StreamOptions
    writable: bool = False
    layout: RankLayout | None = None

    def __post_init__(self) -> None:
        if self.layout is not None and self.layout.world == 1:
            # Ranks of a data-parallel job read their own list and renumber their slots
            # as local shards; a single trainer does neither.
            object.__setattr__(self, "layout", None)


def check_stream_options(options: dict[str, Any]) -> None:
    """Refuse a constructor argument that cannot work, naming it and what was expected
    (the rest are checked where they are used: the URL, the queue's name, dtypes).

    Raises:
        ConfigError: the first invalid argument.
    """
    _check_sources(options["sources"])
    hwm = options["hwm"]
    if not isinstance(hwm, int) or hwm < 1:
        raise ConfigError(f"hwm {hwm!r} is not valid: expected an integer >= 1")
    for name in ("timeout_s", "claim_ttl_s", "stall_s"):
        value = options.get(name, 1.0)
        if not _is_positive(value):
            raise ConfigError(f"{name} {value!r} is not valid: expected > 0 (seconds)")
    limit = options.get("max_frame_bytes")
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
        raise ConfigError(
            f"max_frame_bytes {limit!r} is not valid: expected None or an integer >= 1"
        )
    for name in ("on_bad_frame", "on_producer_error"):
        if options[name] not in ("raise", "skip"):
            raise ConfigError(f"{name} {options[name]!r} is not valid: 'raise' or 'skip'")
    _check_rank(options["rank"], options["world_size"], options["even_batches"])
    _check_group(options.get("group"), options.get("max_lag_batches"))


def _is_positive(value: Any) -> bool:
    """A finite number > 0 (not a string of one: '5' <= 0 raised TypeError)."""
    return (
        isinstance(value, numbers.Real)
        and not isinstance(value, bool)
        and 0 < float(value) < math.inf
    )


def _check_sources(sources: Any) -> None:
    """None, or distinct names (a string is not a tuple of names)."""
    if sources is not None and (
        isinstance(sources, str)
        or not all(isinstance(s, str) for s in sources)
        or len(set(sources)) != len(sources)
    ):
        raise ConfigError(f"sources {sources!r} is not valid: expected a tuple of distinct names")


def _check_group(group: Any, max_lag_batches: Any) -> None:
    """A valid group name (or None), and a lag of None or an integer >= 0."""
    check_group(group)
    lag = max_lag_batches
    if lag is not None and (not isinstance(lag, int) or isinstance(lag, bool) or lag < 0):
        raise ConfigError(f"max_lag_batches {lag!r} is not valid: expected None or an integer >= 0")


def _check_rank(rank: Any, world_size: Any, even_batches: Any) -> None:
    """A rank of a valid world size and even mode."""
    RankLayout(1, world_size, even_batches)  # checks world_size, even_batches
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ConfigError(f"rank {rank!r} is not valid: expected an integer in [0, {world_size})")


def find_rank(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """This process's (rank, world size) in its data-parallel job.

    Explicit arguments win. What is not given comes from ``torch.distributed`` where a
    process group is initialised (Lightning, Accelerate, the transformers Trainer and
    torchrun all initialise one before the loop asks for data), else from the
    ``RANK`` and ``WORLD_SIZE`` environment variables where both are set (torchrun's,
    before ``init_process_group``), else a single process: rank 0 of 1. torch is never
    imported here: without it in ``sys.modules`` there is no process group.

    A ``world_size`` other than the process group's is a data-parallel layout of its
    own (tensor or pipeline parallel ranks beside the data-parallel ones): it needs
    ``rank`` too, and both are taken as given.

    Raises:
        ConfigError: an explicit rank contradicts the initialised process group (both
            named), a world size of its own (other than the group's or the
            environment's) comes without a rank, a rank other than 0 without a world
            size where none is found, or the environment's values are not integers.
    """
    group = _process_group()
    found = group or _environment()
    if found is None:
        if world_size is None and rank not in (None, 0):
            raise ConfigError(
                f"rank={rank!r} without world_size, and no torch.distributed process group "
                "or RANK and WORLD_SIZE to find it in: pass world_size= too"
            )
        return (0 if rank is None else rank), (1 if world_size is None else world_size)
    found_rank, found_world = found
    if world_size is not None and world_size != found_world:
        # Data-parallel ranks fewer than the processes (tensor or pipeline parallelism
        # beside them): the data-parallel rank is the caller's to say.
        if rank is None:
            where = (
                "the initialised torch.distributed process group's"
                if group is not None
                else "the environment's WORLD_SIZE"
            )
            raise ConfigError(
                f"world_size={world_size!r} differs from {where} ({found_world}): pass "
                "rank= too (this process's data-parallel rank), or leave both out"
            )
        return rank, world_size
    if group is not None and rank is not None and rank != found_rank:
        raise ConfigError(
            f"rank={rank!r} contradicts the initialised torch.distributed process group "
            f"(rank {found_rank} of world_size {found_world}): leave rank out (it is "
            "found there), or pass the process group's"
        )
    return (found_rank if rank is None else rank), (
        found_world if world_size is None else world_size
    )


def _process_group() -> tuple[int, int] | None:
    """(rank, world) of torch.distributed's default process group, if initialised."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    return int(dist.get_rank()), int(dist.get_world_size())


def _environment() -> tuple[int, int] | None:
    """(RANK, WORLD_SIZE) from the environment where both are set (torchrun's)."""
    rank, world = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
    if rank is None or world is None:
        return None
    try:
        return int(rank), int(world)
    except ValueError:
        raise ConfigError(
            f"RANK={rank!r} and WORLD_SIZE={world!r} in the environment are not valid: "
            "expected integers (or pass rank= and world_size=)"
        ) from None
