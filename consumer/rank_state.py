"""The checkpoint states of a data-parallel job's ranks: this rank's picked from a list
of every rank's, and the rest of an epoch re-split for another number of ranks.

One state's keys, checks and loading are :mod:`consumer.checkpoint`'s. Every rank saves
its own ``state_dict()``: its position in its own share (local shards, see
:mod:`batchq.protocol.ranks`) plus ``rank``, ``world_size``, ``even_batches``,
``plan_shards`` (S) and ``step`` (batches yielded since the job began).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from batchq.errors import ConfigError, StepMismatch
from batchq.protocol.params_log import ParamsLog, merged
from batchq.protocol.ranks import RankLayout
from consumer.checkpoint import (
    CONSUMED_KEY,
    DONE_KEY,
    EPOCH_BATCHES_KEY,
    EPOCH_KEY,
    EVEN_BATCHES_KEY,
    EVERY_RANK_KEY,
    FINGERPRINT_KEY,
    PARAMS_KEY,
    PLAN_SHARDS_KEY,
    QUEUE_KEY,
    RANK_KEY,
    REMAP_KEY,
    RESPLIT_KEY,
    RUN_KEY,
    SHARD_BATCHES_KEY,
    SHARD_COUNTS_KEY,
    SHARDS_KEY,
    STATE_VERSION,
    STEP_KEY,
    VERSION_KEY,
    WORLD_SIZE_KEY,
    YIELDING_KEY,
)

__all__ = ["elastic_state", "pick_rank_state", "rank_position"]


def pick_rank_state(
    state: dict[str, Any] | Sequence[dict[str, Any]], rank: int, world: int
) -> dict[str, Any]:
    """This rank's state: ``state`` itself, or its entry in a list of every rank's.

    A state marked ``every_rank`` (consumer/checkpoint.py) stands for every rank of its
    checkpoint: another rank of the same world takes it as its own (its rank set; its
    position rebuilt where the plan's last shard is short: :func:`rank_position`), a
    new world re-splits the rest of the epoch as from every old rank's states.

    Raises:
        StepMismatch: the list holds states of different steps (not one checkpoint).
        ConfigError: the list is not one state per rank of this world size.
    """
    if isinstance(state, dict):
        if not state.get(EVERY_RANK_KEY) or not state.get(RUN_KEY):
            return state
        saved_world = state.get(WORLD_SIZE_KEY)
        if not isinstance(saved_world, int) or saved_world < 2:
            raise ConfigError(
                f"state['world_size'] = {saved_world!r} is not valid: expected an integer >= 2"
            )
        if saved_world == world:
            return rank_position(state, rank)
        state = [rank_position(state, r, re_split=True) for r in range(saved_world)]
    states = _state_list(state)
    resplit = _checkpoint_world(states) != world
    if not resplit and all(s.get(EVERY_RANK_KEY) and s.get(RUN_KEY) for s in states):
        # Each stands for every rank: this rank's, read as one (at a Filter's 'drop' end a
        # rank that had not cut its share yet is in the next epoch, as the others are).
        return pick_rank_state(_own_state(states, rank), rank, world)
    states = _in_one_epoch(states, resplit)
    if resplit:
        return elastic_state(states, rank, world)
    return _own_state(states, rank)


def _in_one_epoch(states: list[dict[str, Any]], resplit: bool) -> list[dict[str, Any]]:
    """One checkpoint's states, each in the epoch the job was in: a rank that had
    finished its share of it while the others read on (its run-time pads, or a 'drop'
    cut not made yet) says the next epoch, empty. Re-split for another world, it is in
    the epoch with every local shard done; resumed with as many ranks it is refused
    (:func:`rank_position`'s limit: its epoch would end before the others').

    Raises:
        ConfigError: the states are not of one epoch or the next, or such a rank with as
            many ranks.
    """
    first, ahead = _ahead(states)
    if not ahead:
        return states
    if not resplit:
        raise ConfigError(
            f"rank(s) {sorted(ahead)} had finished their share of epoch {first} while the "
            "others read on (run-time pads, or a 'drop' cut): resumed with as many ranks "
            "their epoch would end before the others'; resume from a checkpoint of "
            "another step (an epoch's end), or with another number of ranks"
        )
    behind = next(s for s in states if int(s.get(RANK_KEY, 0)) not in ahead)
    done = {EPOCH_KEY: first, DONE_KEY: list(range(_saved_layout(behind).per_rank))}
    done |= {REMAP_KEY: behind[REMAP_KEY]} if REMAP_KEY in behind else {}
    return [s | done if int(s.get(RANK_KEY, 0)) in ahead else s for s in states]


def _ahead(states: list[dict[str, Any]]) -> tuple[int, set[int]]:
    """The checkpoint's epoch and the ranks whose states are a step into the next one,
    empty (ranks that had finished their share).

    Raises:
        ConfigError: states of other epochs, or a later one not empty.
    """
    started = [s for s in states if s.get(RUN_KEY)]
    first = min((int(s[EPOCH_KEY]) for s in started), default=0)
    ahead = [s for s in started if int(s[EPOCH_KEY]) != first]
    if not all(_empty_in(s, first + 1) for s in ahead):
        epochs = sorted({int(s[EPOCH_KEY]) for s in started})
        raise ConfigError(f"states of epochs {epochs}: expected one checkpoint's")
    return first, {int(s.get(RANK_KEY, 0)) for s in ahead}


def _empty_in(state: dict[str, Any], epoch: int) -> bool:
    """Whether ``state`` is at the start of ``epoch``, nothing of it yielded."""
    return (
        int(state[EPOCH_KEY]) == epoch and not state.get(CONSUMED_KEY) and not state.get(DONE_KEY)
    )


def _own_state(states: list[dict[str, Any]], rank: int) -> dict[str, Any]:
    """Rank ``rank``'s state in a list of one checkpoint's, refused where a rank yielded
    its run-time pads at that step (:func:`rank_position`)."""
    mine = [s for s in states if s.get(RANK_KEY, 0) == rank]
    if len(mine) != 1:
        raise ConfigError(f"the states hold {len(mine)} states of rank {rank}: expected one")
    if YIELDING_KEY in mine[0]:
        rank_position(mine[0], rank)
    return mine[0]


def rank_position(state: dict[str, Any], rank: int, re_split: bool = False) -> dict[str, Any]:
    """Rank ``rank``'s state at the step of ``state``, a state marked ``every_rank``.

    Where every slot holds as many batches, every rank's position is the state's own.
    Where shards differ (the state carries ``yielding`` = [epoch, k], and the plan's B
    and E where only its last shard is short, else every rank's published shard
    counts), rank ``rank``'s is rebuilt: in plan order it had its local shards' batches
    up to k (a shard builds B, the last one E - (S - 1) x B; or its published count; past
    the shards it had published, it is in the next one). Once k reaches the epoch's
    count (the most any rank holds under 'pad', the fewest under 'drop') the epoch was
    handed out: the next one, empty. For a ``re_split`` (a new world,
    :func:`elastic_state`) a rank whose share is done while the others read on (its
    run-time pads) is in the epoch with every local shard done, so that every old rank's
    state is of that one epoch. Outside a re-split the saving rank keeps its own state.

    Raises:
        ConfigError: the state's figures are not a valid plan; or, outside a re-split,
            a rank yielded its run-time pads at that step: resumed, its pads are not
            replayed and its epoch would end before the others' (ranks that step
            together could not follow), for every rank of the job alike.
    """
    if YIELDING_KEY not in state:
        return state | {RANK_KEY: rank}
    layout, shares, whole = _slot_batches(state)
    epoch, k = state[YIELDING_KEY]
    ended = _handed_out(layout, shares, whole, k)
    if ended:  # the saving rank too: a 'drop' it had not cut yet (a Filter's) is past
        return state | {EPOCH_KEY: epoch + 1, CONSUMED_KEY: {}, DONE_KEY: [], RANK_KEY: rank}
    if not re_split:
        _refuse_inside_pads(shares, whole, epoch, k)
    if state.get(RANK_KEY) == rank and not re_split:
        return state | {RANK_KEY: rank}
    return (
        state | _position_at(shares[rank], k, layout.per_rank) | {EPOCH_KEY: epoch, RANK_KEY: rank}
    )


def _handed_out(
    layout: RankLayout, shares: list[list[int | None]], whole: list[bool], k: int
) -> bool:
    """Whether an epoch whose ranks' local shards hold ``shares`` batches (``whole``: a
    rank's every count is known) was handed out after k batches: k reached its count.
    Under 'drop' no rank yields past the fewest, so one whole share of k or fewer ends
    it; under 'pad' every share must be known."""
    totals = [_total(share) for share, w in zip(shares, whole, strict=True) if w]
    if all(whole):
        return k >= (max(totals) if layout.even == "pad" else min(totals))
    return layout.even == "drop" and any(total <= k for total in totals)


def _total(share: list[int | None]) -> int:
    """The batches of a share's known shards."""
    return sum(n for n in share if n is not None)


def _refuse_inside_pads(
    shares: list[list[int | None]], whole: list[bool], epoch: int, k: int
) -> None:
    """Refuse a same-world resume from ``k`` batches into ``epoch`` where a rank yielded
    its run-time pads then (see :func:`rank_position`)."""
    padding = [r for r, share in enumerate(shares) if whole[r] and _total(share) <= k]
    if padding:
        raise ConfigError(
            f"state taken {k} batches into epoch {epoch}, while rank(s) {padding} yielded "
            "their run-time pads (their shares end before the epoch's count): resumed "
            "with as many ranks, their pads are not replayed and their epoch would end "
            "before the others'; resume from a checkpoint of another step (an epoch's "
            "end), or with another number of ranks (re-split)"
        )


def _position_at(share: list[int | None], k: int, per_rank: int) -> dict[str, Any]:
    """A rank's position after ``k`` batches of an epoch whose local shards 0, 1, ...
    hold ``share`` batches (None: not said), yielded in plan order: batches had per
    shard, shards done (an empty one wherever it is: a re-split must not deal it to a
    rank as a unit). Past the shards said in a row it is in the first one not said
    (every shard a rank passed was said before it yielded past it)."""
    had, done, before, inside = {}, [], 0, False
    for j, n in enumerate([*share, *[None] * (per_rank - len(share))]):
        if n == 0:
            done.append(j)
        elif n is None or inside:
            if not inside and k > before:
                had[str(j)] = k - before
            inside = True
        else:
            if k >= before + n:
                done.append(j)
            if min(n, k - before) > 0:
                had[str(j)] = min(n, k - before)
            before += n
    return {CONSUMED_KEY: had, DONE_KEY: done}


def _slot_batches(
    state: dict[str, Any],
) -> tuple[RankLayout, list[list[int | None]], list[bool]]:
    """The saved job's layout, the batches of every rank's local shards of an epoch (as
    far as known) and whether each rank's list is its whole share, for a state carrying
    ``yielding`` and either the plan's B and E or every rank's published shard counts.

    Raises:
        ConfigError: the state's figures are not a valid plan.
    """
    yielding, layout = state[YIELDING_KEY], _saved_layout(state)
    valid = isinstance(yielding, list) and list(map(type, yielding)) == [int, int]
    valid = valid and min(yielding) >= 0
    if SHARD_COUNTS_KEY in state:
        counts = state[SHARD_COUNTS_KEY]
        if valid and _valid_counts(counts, layout):
            whole = [len(s) == layout.per_rank and None not in s for s in counts]
            return layout, counts, whole
        raise ConfigError(
            f"state's yielding {yielding!r} and shard_counts {counts!r} are not valid: "
            f"expected [epoch, batches] >= 0 and {layout.world} lists of at most "
            f"{layout.per_rank} batch counts >= 0 (or null)"
        )
    batches, epoch_batches = state.get(SHARD_BATCHES_KEY), state.get(EPOCH_BATCHES_KEY)
    shares = None
    if valid and isinstance(batches, int) and isinstance(epoch_batches, int):
        shares = layout.slot_batches(batches, epoch_batches)
    if shares is None:
        raise ConfigError(
            f"state's yielding {yielding!r}, shard_batches {batches!r} and epoch_batches "
            f"{epoch_batches!r} are not valid: expected [epoch, batches] >= 0 and a plan "
            f"of {layout.shards} shards of B batches whose last holds 1 to B"
        )
    known: list[list[int | None]] = [[*share] for share in shares]
    return layout, known, [True] * layout.world


def _valid_counts(counts: Any, layout: RankLayout) -> bool:
    """Whether ``counts`` is one list per rank of at most P batch counts >= 0."""
    if not isinstance(counts, list) or len(counts) != layout.world:
        return False
    return all(
        isinstance(share, list)
        and len(share) <= layout.per_rank
        and all(n is None or (type(n) is int and n >= 0) for n in share)
        for share in counts
    )


def _saved_layout(state: dict[str, Any]) -> RankLayout:
    """The layout of the job that saved ``state`` (its S, world size and even mode)."""
    shards = state.get(PLAN_SHARDS_KEY)
    if not isinstance(shards, int) or shards < 1:
        raise ConfigError(f"state['plan_shards'] = {shards!r} is not valid: expected >= 1")
    return RankLayout(shards, int(state[WORLD_SIZE_KEY]), str(state.get(EVEN_BATCHES_KEY)))


def _state_list(state: Any) -> list[dict[str, Any]]:
    """``state`` as a list of state dicts, or ConfigError."""
    if not isinstance(state, Sequence) or isinstance(state, str | bytes):
        raise ConfigError(f"state {state!r} is not valid: expected a dict or a list of dicts")
    states = list(state)
    if not all(isinstance(s, dict) for s in states):
        raise ConfigError("states are not valid: expected a list of state_dict() dicts")
    return states


def _checkpoint_world(states: list[dict[str, Any]]) -> int:
    """The world size of the one checkpoint the states make (one state per rank).

    Raises:
        StepMismatch: states of different steps.
        ConfigError: not one state per rank of one world size.
    """
    steps = {int(s.get(STEP_KEY, 0)) for s in states if s.get(RUN_KEY)}
    if len(steps) > 1:
        where = ", ".join(f"rank {s.get('rank')}: step {s.get('step')}" for s in states)
        raise StepMismatch(f"the states are of different steps ({where}); expected one checkpoint")
    worlds = {s.get(WORLD_SIZE_KEY, 1) for s in states}
    if len(worlds) != 1 or len(states) != next(iter(worlds)):
        raise ConfigError(
            f"{len(states)} states of world_size {sorted(worlds)}: expected one state per "
            "rank of the checkpointed job"
        )
    return int(next(iter(worlds)))


def elastic_state(states: list[dict[str, Any]], rank: int, world: int) -> dict[str, Any]:
    """This new rank's state when a job of R ranks resumes with ``world`` ranks.

    The rest of the checkpointed epoch, every shard of the plan that no old rank had
    yielded completely (a partly yielded one from its next batch; the old pads are
    padding and go), in plan order, is re-split among the new ranks as slots are
    (:mod:`batchq.protocol.ranks`): unit u goes to rank u % world, pads repeat the first units.
    Every new rank computes the same ``remap`` (new slot -> [shard, batches had]); the
    epoch's slots past it are empty (done). States taken inside an epoch re-split before
    (they carry its remap) give their units through that remap: each shard's first slot
    (a later one is a pad, and goes) not yielded completely, with the batches its rank
    had of it.

    Raises:
        ConfigError: states of different runs or epochs, or a new world of 1.
    """
    if world < 2:
        raise ConfigError(
            f"resuming {len(states)} ranks' states with world_size {world}: expected "
            "world_size >= 2 (a single trainer cannot take a job's share apart yet)"
        )
    _check_one_job(states)
    first = states[0]
    old = RankLayout(int(first[PLAN_SHARDS_KEY]), len(states), str(first[EVEN_BATCHES_KEY]))
    units = _units_left(states, old)
    new = RankLayout(old.shards, world, old.even)
    share = _share(len(units), world, new.even)
    remap = [list(units[u % len(units)]) for u in range(share * world)]
    own = range(rank, share * world, world)
    return {
        VERSION_KEY: STATE_VERSION,
        QUEUE_KEY: first.get(QUEUE_KEY),
        RUN_KEY: first[RUN_KEY],
        FINGERPRINT_KEY: first[FINGERPRINT_KEY],
        SHARDS_KEY: new.per_rank,
        PLAN_SHARDS_KEY: old.shards,
        EPOCH_KEY: int(first[EPOCH_KEY]),
        CONSUMED_KEY: {str(u // world): remap[u][1] for u in own if remap[u][1]},
        DONE_KEY: list(range(share, new.per_rank)),
        RANK_KEY: rank,
        WORLD_SIZE_KEY: world,
        EVEN_BATCHES_KEY: old.even,
        STEP_KEY: int(first.get(STEP_KEY, 0)),
        REMAP_KEY: remap,
        RESPLIT_KEY: True,
        **_params_of(states),
    }


def _params_of(states: list[dict[str, Any]]) -> dict[str, Any]:
    """The job's params log, kept through the re-split: the longest of the ranks' logs
    (each a prefix of the run's), or nothing where none changed the params."""
    log = ParamsLog()
    for state in states:
        log = merged(log, ParamsLog.from_json(state.get(PARAMS_KEY), "state['params']"))
    return {PARAMS_KEY: log.to_json()} if log else {}


def _check_one_job(states: list[dict[str, Any]]) -> None:
    """Refuse states of different runs, epochs, plans, even modes or remaps."""
    keys = (RUN_KEY, EPOCH_KEY, PLAN_SHARDS_KEY, FINGERPRINT_KEY, EVEN_BATCHES_KEY, REMAP_KEY)
    for key in keys:
        values = {repr(s.get(key)) for s in states}
        if len(values) != 1:
            raise ConfigError(
                f"the states disagree on {key!r} ({sorted(values)}): expected one job"
            )


def _units_left(states: list[dict[str, Any]], old: RankLayout) -> list[tuple[int, int]]:
    """(shard, batches had) of every shard of the plan that no old rank had yielded
    completely, in plan order (the old pads are padding and go)."""
    by_rank = {int(s.get(RANK_KEY, 0)): s for s in states}
    if REMAP_KEY in states[0]:  # inside an epoch re-split before: its slots build these
        return _remapped_units_left(by_rank, states[0][REMAP_KEY], old.world)
    units = []
    for shard in range(old.shards):
        owner = by_rank[shard % old.world]
        local = shard // old.world
        if local not in owner[DONE_KEY]:
            units.append((shard, int(owner[CONSUMED_KEY].get(str(local), 0))))
    return units


def _remapped_units_left(
    by_rank: dict[int, dict[str, Any]], remap: list[list[int]], world: int
) -> list[tuple[int, int]]:
    """(shard, batches had) of every unit of a re-split epoch's ``remap`` that its rank
    had not yielded completely, in the remap's (the plan's) order. Slot u is rank
    u % world's local slot u // world; a shard's first slot is its unit, a later one a pad
    (pads repeat the first units) and goes. The batches had are the rank's count (the
    remap's base, preloaded, plus what it yielded since)."""
    units, seen = [], set()
    for u, (shard, _) in enumerate(remap):
        if shard in seen:
            continue
        seen.add(shard)
        owner, local = by_rank[u % world], u // world
        if local not in owner[DONE_KEY]:
            units.append((shard, int(owner[CONSUMED_KEY].get(str(local), 0))))
    return units


def _share(units: int, world: int, even: str) -> int:
    """Units per new rank: rounded up ('pad': the first units repeat) or down."""
    return -(-units // world) if even == "pad" else units // world
