"""Checkpoint states of a data-parallel job's ranks: picking, checking, naming the run.

Every rank saves its own ``state_dict()``: its position in its own share (local shards,
see :mod:`batchq.ranks`) plus ``rank``, ``world_size``, ``even_batches``,
``plan_shards`` (S) and ``step`` (batches yielded since the job began). The ranks of
one checkpoint resume into one run whose id every rank computes alike
(:func:`resume_run_id`), so the first to resume creates it and the others join it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

from batchq.errors import ConfigError, StepMismatch

__all__ = ["check_rank_state", "pick_rank_state", "resume_run_id"]


def pick_rank_state(
    state: dict[str, Any] | Sequence[dict[str, Any]], rank: int, world: int
) -> dict[str, Any]:
    """This rank's state: ``state`` itself, or its entry in a list of every rank's.

    Raises:
        StepMismatch: the list holds states of different steps (not one checkpoint).
        ConfigError: the list is not one state per rank of this world size.
    """
    if isinstance(state, dict):
        return state
    if not isinstance(state, Sequence) or isinstance(state, str | bytes):
        raise ConfigError(f"state {state!r} is not valid: expected a dict or a list of dicts")
    states = list(state)
    if not all(isinstance(s, dict) for s in states):
        raise ConfigError("states are not valid: expected a list of state_dict() dicts")
    steps = {int(s.get("step", 0)) for s in states if s.get("run")}
    if len(steps) > 1:
        where = ", ".join(f"rank {s.get('rank')}: step {s.get('step')}" for s in states)
        raise StepMismatch(f"the states are of different steps ({where}); expected one checkpoint")
    worlds = {s.get("world_size", 1) for s in states}
    if worlds != {world} or len(states) != world:
        raise ConfigError(
            f"{len(states)} states of world_size {sorted(worlds)} given to a rank of "
            f"world_size {world}: expected one state per rank of this world size "
            "(resuming with another number of ranks is not supported yet)"
        )
    mine = [s for s in states if s.get("rank", 0) == rank]
    if len(mine) != 1:
        raise ConfigError(f"the states hold {len(mine)} states of rank {rank}: expected one")
    return mine[0]


def check_rank_state(state: dict[str, Any], rank: int, world: int) -> None:
    """Refuse a state saved by another rank or another world size.

    Raises:
        ConfigError: naming the state's rank/world and this stream's.
    """
    saved_world, saved_rank = state.get("world_size", 1), state.get("rank", 0)
    if saved_world != world or saved_rank != rank:
        raise ConfigError(
            f"state of rank {saved_rank!r} of world_size {saved_world!r} given to rank "
            f"{rank} of world_size {world}: expected this rank's own state"
        )
    step = state.get("step", 0)
    if not isinstance(step, int) or step < 0:
        raise ConfigError(f"state['step'] = {step!r} is not valid: expected an integer >= 0")


def resume_run_id(state: dict[str, Any], world: int) -> str:
    """The run id every rank of one checkpoint resumes into ('' for a single trainer:
    the session mints one)."""
    if world == 1:
        return ""
    # Not the step: a rank resuming from another step must find the run and be refused.
    text = f"resume:{state.get('run')}:{world}"
    return hashlib.sha1(text.encode()).hexdigest()[:16]
