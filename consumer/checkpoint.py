"""A trainer's checkpoint: its keys, its assembly, its checks and its loading, in one place.

The state (``ServerDataStream.state_dict()``) is a file format: its keys never change.

A state is a JSON-able dict (torch.save, json.dump and pickle all keep it)::

    version       1 (STATE_VERSION)
    queue         the queue's name
    run           the run id ('' before the first batch: nothing to resume)
    fingerprint   the pipeline's fingerprint (producers of another pipeline are refused)
    shards        S, the shards of one epoch (a rank: its own share)
    epoch         the oldest epoch not yet yielded completely
    consumed      shard -> batches of it yielded in that epoch (keys are strings: JSON)
    done          shards of that epoch yielded completely
  data-parallel ranks (world_size > 1) add:
    rank, world_size, even_batches ('pad' | 'drop'), plan_shards (the plan's S),
    step (batches the rank yielded: every rank of one checkpoint has the same),
    every_rank    (where true) this state is every rank's at this step, its rank aside:
                  every slot holds as many batches (every shard one batch, or every
                  shard full: B batches) and epochs are yielded in plan order, so
                  after the same number of batches every rank's local position is the
                  same; any rank (or a new world, re-split) resumes from it, so a
                  checkpoint that keeps rank 0's state only resumes the whole job
  where only the epoch's last shard is short (every_rank too: positions differ between
  ranks at one step, but each follows from the plan and the batches yielded) it adds:
    yielding      [epoch, batches]: the epoch the rank is yielding and the batches it
                  yielded of it, run-time pads included: the same on every rank at one
                  step (every rank yields as many per epoch)
    shard_batches B, batches per full shard; epoch_batches: E, batches per epoch
                  (the last shard holds E - (S - 1) x B): each rank's position is
                  rebuilt from them (consumer/rank_state.py ``rank_position``)
  where the plan cannot count its shards (a Filter, shards skipped on an error) and
  ordered=True (every_rank too) it adds ``yielding`` and:
    shard_counts  per rank, the batches of its local shards 0, 1, ... of that epoch that
                  the rank had published when the state was taken (null: not yet;
                  every shard its batches up to this step passed is: ranks step
                  together), from which each rank's position is rebuilt
  and a state re-split for another number of ranks (consumer/rank_state.py) adds:
    remap         slot -> [shard, batches had]: what each slot of the resumed epoch builds
                  (a shard's later slots are pads), kept while in that epoch
    resplit       (until read from) a resume sends every slot's pairs, not the rank's
  a group of a run read by several groups (``group=``) adds:
    group         its name (a state of another group is refused)
  and once ``set_params`` was called:
    params        the run's change log of producer parameters, a list of entries
                  {version, index, id, params} (batchq/protocol/params_log.py): a resume
                  writes it back, so the resumed stream is the same even if Redis lost
                  the queue

Assembled from the stream's position (:func:`stream_state`), checked when it is loaded
(:func:`check_state`, :func:`check_rank_state`, :func:`check_group_state`: it comes from a
file), and loaded into a claimed run (:func:`resume_position`: the ledger preloaded, the
same pairs sent to resume.lua). The ranks (and groups) of one checkpoint resume into one
run whose id each computes alike (:func:`resume_run_id`), so the first to resume creates
it and the others join it. A list of every rank's states, and a state re-split for
another number of ranks, are :mod:`consumer.rank_state`'s.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from batchq.client.connection import retrying
from batchq.errors import ConfigError
from batchq.protocol import layout
from batchq.protocol.layout import DONE, ledger_field
from batchq.protocol.params_log import ParamsLog
from batchq.protocol.ranks import RankLayout
from batchq.protocol.stripes import RemapShare, Stripes
from consumer.plan import BLOCK_S, Plan
from consumer.reader.ledger import Ledger, global_pairs
from consumer.session import Session
from consumer.stream_options import StreamOptions

__all__ = [
    "CONSUMED_KEY",
    "DONE_KEY",
    "EPOCH_BATCHES_KEY",
    "EPOCH_KEY",
    "EVEN_BATCHES_KEY",
    "EVERY_RANK_KEY",
    "FINGERPRINT_KEY",
    "GROUP_KEY",
    "PARAMS_KEY",
    "PLAN_SHARDS_KEY",
    "QUEUE_KEY",
    "RANK_KEY",
    "REMAP_KEY",
    "RESPLIT_KEY",
    "RUN_KEY",
    "SHARDS_KEY",
    "SHARD_BATCHES_KEY",
    "SHARD_COUNTS_KEY",
    "STATE_VERSION",
    "STEP_KEY",
    "VERSION_KEY",
    "WORLD_SIZE_KEY",
    "YIELDING_KEY",
    "Resumed",
    "check_group_state",
    "check_rank_state",
    "check_state",
    "load_state",
    "position_digest",
    "position_state",
    "rank_fields",
    "remap_pairs",
    "resume_position",
    "resume_run_id",
    "resumed_batches",
    "stream_state",
    "unstarted_state",
]

STATE_VERSION = 1

VERSION_KEY = "version"
QUEUE_KEY = "queue"
RUN_KEY = "run"
FINGERPRINT_KEY = "fingerprint"
SHARDS_KEY = "shards"
EPOCH_KEY = "epoch"
CONSUMED_KEY = "consumed"
DONE_KEY = "done"
RANK_KEY = "rank"
WORLD_SIZE_KEY = "world_size"
EVEN_BATCHES_KEY = "even_batches"
PLAN_SHARDS_KEY = "plan_shards"
STEP_KEY = "step"
EVERY_RANK_KEY = "every_rank"
YIELDING_KEY = "yielding"
SHARD_BATCHES_KEY = "shard_batches"
SHARD_COUNTS_KEY = "shard_counts"
EPOCH_BATCHES_KEY = "epoch_batches"
REMAP_KEY = "remap"
RESPLIT_KEY = "resplit"
GROUP_KEY = "group"
PARAMS_KEY = "params"


def unstarted_state(queue: str) -> dict[str, Any]:
    """The state of a stream that has not read anything: nothing to resume."""
    return {VERSION_KEY: STATE_VERSION, QUEUE_KEY: queue, RUN_KEY: "", FINGERPRINT_KEY: ""}


def position_state(
    queue: str,
    run: str,
    fingerprint: str,
    shards: int,
    epoch: int,
    consumed: Mapping[int, int],
    done: Sequence[int],
) -> dict[str, Any]:
    """The state at a position: ``consumed`` shard -> batches yielded of ``epoch``,
    ``done`` its shards yielded completely."""
    return {
        VERSION_KEY: STATE_VERSION,
        QUEUE_KEY: queue,
        RUN_KEY: run,
        FINGERPRINT_KEY: fingerprint,
        SHARDS_KEY: shards,
        EPOCH_KEY: epoch,
        CONSUMED_KEY: {str(s): n for s, n in consumed.items()},
        DONE_KEY: list(done),
    }


def rank_fields(
    rank: int,
    world_size: int,
    even_batches: str,
    plan_shards: int,
    step: int,
    every_rank: bool = False,
) -> dict[str, Any]:
    """What a data-parallel rank's state adds (world_size > 1)."""
    fields: dict[str, Any] = {
        RANK_KEY: rank,
        WORLD_SIZE_KEY: world_size,
        EVEN_BATCHES_KEY: even_batches,
        PLAN_SHARDS_KEY: plan_shards,
        STEP_KEY: step,
    }
    return fields | {EVERY_RANK_KEY: True} if every_rank else fields


def _slots_alike(plan: Plan | None, remapped: bool) -> bool:
    """Whether every slot of the epoch holds as many batches (every_rank, the module's
    docstring): every shard one batch, or every shard full (B batches, the epoch's last
    one too, so a pad, a copy of a first shard, is full as well), outside an epoch whose
    slots build a re-split's remapped pieces."""
    if plan is None:
        return False
    if plan.epoch_batches == plan.shards:
        return True
    full = plan.shard_batches > 0 and plan.epoch_batches == plan.shards * plan.shard_batches
    return full and not remapped


def _last_short(plan: Plan | None, remapped: bool) -> bool:
    """Whether only the epoch's last shard is short (B batches each, the last fewer but
    one at least), outside a re-split's remapped epoch: each rank's position after k
    batches of an epoch then follows from the plan (every_rank, with ``yielding``)."""
    if plan is None or plan.shards < 1 or remapped:
        return False
    counts = RankLayout(plan.shards).shard_counts(plan.shard_batches, plan.epoch_batches)
    return counts is not None and counts[-1] < plan.shard_batches


def _rank_part(
    options: StreamOptions,
    plan: Plan | None,
    remapped: bool,
    plan_shards: int,
    step: int,
    yielding: tuple[int, int],
    published: Callable[[int], list[list[int | None]] | None] | None,
    resumed: Mapping[str, Any] | None,
) -> dict[str, Any]:
    """A rank's fields, marked every_rank where its position stands for every rank's;
    where only the plan's last shard is short, with what rebuilds each rank's; where
    the plan cannot count its shards, with every rank's published shard counts."""
    # A shard skipped on a producer's error holds fewer batches than the plan says: its
    # ranks' published counts say where they are, where they publish them (one batch a
    # shard evens nothing at run time: its slots alike stand, exact unless one is skipped).
    trusted = options.ordered and options.on_producer_error != "skip"
    short = trusted and _last_short(plan, remapped)
    alike = options.ordered and _slots_alike(plan, remapped)
    counts = None
    if options.ordered and not (short or (alike and trusted) or remapped) and published:
        counts = _with_resumed(published(yielding[0]), resumed, yielding[0])
    fields = rank_fields(
        options.rank, options.world_size, options.even_batches, plan_shards, step,
        short or alike or counts is not None,
    )  # fmt: skip
    if counts is not None:
        return fields | {YIELDING_KEY: list(yielding), SHARD_COUNTS_KEY: counts}
    if not short or plan is None:
        return fields
    return fields | {
        YIELDING_KEY: list(yielding),
        SHARD_BATCHES_KEY: plan.shard_batches,
        EPOCH_BATCHES_KEY: plan.epoch_batches,
    }


def _with_resumed(
    counts: list[list[int | None]] | None, resumed: Mapping[str, Any] | None, epoch: int
) -> list[list[int | None]] | None:
    """``counts`` with what they do not say taken from the state the stream resumed
    from, where its counts are of ``epoch``: a resume drops the counts published before
    it, and each rank says its own again only as it reads on (a state taken between
    still says where every rank is)."""
    if counts is None or not resumed or SHARD_COUNTS_KEY not in resumed:
        return counts
    if (resumed.get(YIELDING_KEY) or [None])[0] != epoch:
        return counts
    before: list[list[int | None]] = resumed[SHARD_COUNTS_KEY]
    out = []
    for r, share in enumerate(counts):
        old = before[r] if r < len(before) else []
        merged = [
            share[j]
            if j < len(share) and share[j] is not None
            else (old[j] if j < len(old) else None)
            for j in range(max(len(share), len(old)))
        ]
        while merged and merged[-1] is None:
            merged.pop()
        out.append(merged)
    return out


def resumed_batches(resumed: Mapping[str, Any] | None, epoch: int) -> int:
    """The batches of ``epoch`` a rank had yielded before the checkpoint it resumed from
    (ordered: its position's count; 0 outside that epoch). In an epoch re-split for
    another world the position counts each slot's batches had when it was re-split (of
    other ranks): those are not the rank's."""
    if not resumed or not resumed.get(RUN_KEY) or int(resumed.get(EPOCH_KEY, -1)) != epoch:
        return 0
    had = sum(int(n) for n in resumed.get(CONSUMED_KEY, {}).values())
    if REMAP_KEY in resumed:
        rank, world = int(resumed.get(RANK_KEY, 0)), int(resumed.get(WORLD_SIZE_KEY, 1))
        had -= sum(unit[1] for unit in resumed[REMAP_KEY][rank::world])
    return had


def stream_state(
    options: StreamOptions,
    run: str,
    plan: Plan | None,
    shards: int,
    position: tuple[int, Mapping[int, int], Sequence[int]],
    *,
    step: int,
    plan_shards: int,
    params: list[dict[str, Any]] | None,
    resumed: dict[str, Any] | None = None,
    yielding: tuple[int, int] = (0, 0),
    published: Callable[[int], list[list[int | None]] | None] | None = None,
) -> dict[str, Any]:
    """The state of a stream of ``options`` at ``position`` in ``run`` (the buffer's
    ``consumed``: the epoch, shard -> batches yielded of it, its shards done): a rank
    adds its fields, a group its name, a changed params log the log, a rank still in the
    epoch its checkpoint re-split (``resumed``'s remap) the remap.

    Args:
        step: batches the rank yielded since the job began.
        plan_shards: S of the run's plan.
        params: the params log as JSON (None: never changed).
        resumed: the state the stream resumed from (None: none).
        yielding: the epoch the rank is yielding and the batches it yielded of it (run-time
            pads included), written where only the plan's last shard is short, or where
            ``published`` gives every rank's shard counts.
        published: every rank's published shard counts of an epoch (None: not
            published; :meth:`consumer.balance.Balancer.shard_counts`).
    """
    epoch, counts, done = position
    fingerprint = plan.fingerprint if plan else ""
    state = position_state(options.queue, run, fingerprint, shards, epoch, counts, done)
    remap_epoch = int(resumed[EPOCH_KEY]) if resumed and REMAP_KEY in resumed else None
    remapped = remap_epoch == epoch
    if options.world_size > 1:
        # A rank past the re-split epoch whose batches the others may still yield (its
        # run-time pads: ``yielding`` is still of it) stands for no other rank either.
        inside = remap_epoch in (epoch, yielding[0])
        state |= _rank_part(options, plan, inside, plan_shards, step, yielding, published, resumed)
    if remapped and resumed is not None:
        # The epoch's slots build the remapped shards: a resume from here needs the map.
        state[REMAP_KEY] = resumed[REMAP_KEY]
    if options.group is not None:
        state[GROUP_KEY] = options.group
    return state if params is None else state | {PARAMS_KEY: params}


# -- checks (a state comes from a file) --------------------------------------------------


def check_state(state: Any, queue: str) -> dict[str, Any]:
    """Validate a state dict, naming what is wrong (it comes from a file)."""
    if not isinstance(state, dict):
        raise ConfigError(f"state {state!r} is not valid: expected a dict from state_dict()")
    if state.get(VERSION_KEY) != STATE_VERSION:
        raise ConfigError(f"state version {state.get('version')!r} is not valid: expected 1")
    if state.get(QUEUE_KEY) not in (None, queue):
        raise ConfigError(f"state is of queue {state.get('queue')!r}, this stream reads {queue!r}")
    if not state.get(RUN_KEY):
        return dict(state)  # taken before the first iteration: nothing to resume
    for name, kind in ((RUN_KEY, str), (FINGERPRINT_KEY, str), (SHARDS_KEY, int), (EPOCH_KEY, int)):
        if not isinstance(state.get(name), kind):
            raise ConfigError(
                f"state[{name!r}] = {state.get(name)!r} is not valid: expected {kind.__name__}"
            )
    _check_position(state.get(CONSUMED_KEY), state.get(DONE_KEY))
    _check_remap(state.get(REMAP_KEY, []))
    ParamsLog.from_json(state.get(PARAMS_KEY), "state['params']")  # ConfigError if bad
    return dict(state)


def _check_position(consumed: Any, done: Any) -> None:
    """Refuse a position that is not shard -> batches yielded, and a list of shards."""
    if not isinstance(consumed, dict) or not all(
        str(k).isdigit() and isinstance(v, int) and v >= 0 for k, v in consumed.items()
    ):
        raise ConfigError(
            f"state['consumed'] = {consumed!r} is not valid: expected shard -> batches"
        )
    if not isinstance(done, list) or not all(isinstance(s, int) for s in done):
        raise ConfigError(f"state['done'] = {done!r} is not valid: expected a list of shards")


def _check_remap(remap: Any) -> None:
    """Refuse a remap that is not a list of [shard, batches had]."""
    units: list[Any] = remap if isinstance(remap, list) else [None]
    if not all(isinstance(u, list) and list(map(type, u)) == [int, int] for u in units):
        raise ConfigError(f"state['remap'] = {remap!r} is not valid: expected [shard, batches]s")
    if any(min(u) < 0 for u in units):
        raise ConfigError(f"state['remap'] = {remap!r} is not valid: expected numbers >= 0")


def check_rank_state(state: dict[str, Any], rank: int, world: int) -> None:
    """Refuse a state saved by another rank or another world size.

    Raises:
        ConfigError: naming the state's rank/world and this stream's.
    """
    saved_world, saved_rank = state.get(WORLD_SIZE_KEY, 1), state.get(RANK_KEY, 0)
    if saved_world != world or saved_rank != rank:
        raise ConfigError(
            f"state of rank {saved_rank!r} of world_size {saved_world!r} given to rank "
            f"{rank} of world_size {world}: expected this rank's own state, or the list of "
            "every rank's (one rank's state stands for every rank with ordered=True, "
            "outside an epoch re-split for another world: not with ordered=False; see "
            "'every_rank' in the README)"
        )
    step = state.get(STEP_KEY, 0)
    if not isinstance(step, int) or step < 0:
        raise ConfigError(f"state['step'] = {step!r} is not valid: expected an integer >= 0")


def load_state(state: Any, options: StreamOptions) -> dict[str, Any]:
    """``state`` checked for a stream of ``options`` (:func:`check_state`; a state of
    another group or, once it names a run, of another rank is refused).

    Raises:
        ConfigError: naming what is wrong.
    """
    loaded = check_group_state(check_state(state, options.queue), options.group)
    if loaded.get(RUN_KEY):
        check_rank_state(loaded, options.rank, options.world_size)
    return loaded


def check_group_state(state: dict[str, Any], group: str | None) -> dict[str, Any]:
    """A checkpoint's state for a stream of ``group``: refused when it names another
    group (each group's position is its own); a state without a group (the default
    group's, or saved before groups) is taken as it is.

    Raises:
        ConfigError: the state names another group.
    """
    saved = state.get(GROUP_KEY)
    if saved is not None and saved != (group or ""):
        raise ConfigError(
            f"state is of group {saved or '(default)'!r}, this stream reads group "
            f"{group or '(default)'!r}; expected a state_dict() of the same group"
        )
    return state


def position_digest(state: Mapping[str, Any], host: str | None) -> str:
    """A digest of a state (its canonical JSON) and of the trainer's shared-memory host
    identity (None: it takes nothing by shared memory): a single trainer that detaches
    marks its run with the digest of its state then and its host (:mod:`consumer.detach`),
    and a resume from a state with the same digest by a trainer of the same host (which
    can map every descriptor listed for the one before) takes that run over as it is
    (resume.lua)."""
    text = json.dumps([state, host], sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha1(text.encode()).hexdigest()[:20]


# -- loading: a claimed run resumed at the state's position ------------------------------


def resume_run_id(state: dict[str, Any], world: int, group: str | None) -> str:
    """The run id a stream resumes ``state``'s run into: every rank of a job, and every
    group of a run (a sweep's groups resume into one run), computes the same, so the
    first creates it and the others join it; '' for a single trainer of the default
    group (the session mints one)."""
    if world == 1 and group is None:
        return ""
    return layout.resume_run_id(str(state.get(RUN_KEY)), world)


class Resumed(NamedTuple):
    """Where a resumed run stands: this rank's slots, its preloaded ledger, and S of the
    run's plan (the checkpoint's, where no producer has joined this Redis yet); for a
    checkpoint of a striped queue also the first shard and every stripe's ledger pairs
    (in its numbers, local), which its other stripes resume from
    (:mod:`consumer.start`)."""

    layout: RankLayout
    ledger: Ledger
    plan_shards: int
    first: int = 0
    stripe_pairs: dict[int, list[tuple[str, str]]] | None = None
    # A checkpoint of another number of ranks: every stripe's ledger pairs (of the new
    # slots, in its numbers, global) and remap, which it resumes from instead.
    stripe_remaps: dict[int, RemapShare] | None = None


def resume_position(
    session: Session, resume: dict[str, Any], *, ordered: bool, step: int, timeout_s: float
) -> Resumed:
    """Recreate a checkpoint's position: the ledger preloaded with what the state says
    was yielded, the same pairs sent to resume.lua (the producers re-plan the saved epoch
    from them).

    Args:
        session: the trainer's session (its plan is set here; its client is the stream's).
        resume: the checkpoint (one rank's state, see the module docstring).
        ordered: the ledger yields in plan order.
        step: batches yielded before the checkpoint (resume.lua checks it).
        timeout_s: the stream's reconnect bound, and how long to wait for a plan.
    """
    client, keys = session.client, session.keys

    def read_meta() -> dict[bytes, bytes]:
        return client.hgetall(keys.meta)  # type: ignore[return-value]

    # The plan first: a striped queue's stripes are resumed each from its own pairs.
    # (A producer may never have joined this Redis: it restarted.)
    meta = retrying(read_meta, f"reading meta (queue {keys.queue})", timeout_s, client=client)
    plan = session.use_plan(meta) or session.wait_for_plan(timeout_s, BLOCK_S)
    stripes = Stripes(plan.stripes)
    shards, epoch = int(resume[SHARDS_KEY]), int(resume[EPOCH_KEY])
    plan_shards = int(resume.get(PLAN_SHARDS_KEY, shards))
    layout = session.layout(plan_shards)
    ledger = Ledger(shards, ordered=ordered, first_epoch=epoch)
    local = _preload(ledger, resume)
    split = stripes.split(local, shards)
    pairs = global_pairs(split[0], layout, session.rank)
    remap, remaps = None, None
    if REMAP_KEY in resume:  # the epoch's rest re-split (for this number of ranks)
        pairs, slots = remap_pairs(resume, layout)
        if not resume.get(RESPLIT_KEY):  # read from since: the rank's own pairs, and the
            # slots past the remap (done for every rank: never built, whoever is first)
            pairs = [p for p in pairs if p[1] == DONE] + global_pairs(local, layout, session.rank)
        remap = (epoch, slots)
        if stripes.striped:  # each stripe its share of the new slots, in its numbers
            remaps = stripes.split_remap(pairs, remap, layout)
            pairs, remap = remaps[0]
    first = epoch * shards
    session.resume(
        client,
        stripes.floor_of(first, 0),
        resume[FINGERPRINT_KEY],
        pairs,
        step=step,
        shards=plan_shards,
        remap=remap,
        keep="" if stripes.striped else position_digest(resume, session.shm_identity),
    )
    if session.plan is None:
        session.wait_for_plan(timeout_s, BLOCK_S)
    return Resumed(layout, ledger, plan_shards, first, split if stripes.striped else None, remaps)


def _preload(ledger: Ledger, resume: dict[str, Any]) -> list[tuple[str, str]]:
    """Mark in the ledger what the checkpoint says was yielded; the same as ledger pairs
    of the rank's own (local) shards, ``'<epoch>:<j>'``."""
    epoch = int(resume[EPOCH_KEY])
    done = set(resume[DONE_KEY])
    pairs = []
    for shard in sorted(done | {int(k) for k in resume[CONSUMED_KEY]}):
        had = int(resume[CONSUMED_KEY].get(str(shard), 0))
        ledger.preload(epoch, shard, had, done=shard in done)
        pairs.append((ledger_field(epoch, shard), DONE if shard in done else str(had)))
    return pairs


def remap_pairs(
    state: dict[str, Any], layout: RankLayout
) -> tuple[list[tuple[str, str]], dict[int, int]]:
    """For an :func:`elastic_state`: the ledger pairs of every slot of the resumed epoch
    (batches had, or done for the slots past the re-split) and slot -> shard to build."""
    epoch, remap = int(state[EPOCH_KEY]), state[REMAP_KEY]
    pairs = []
    for slot in range(layout.slots):
        if slot >= len(remap):
            pairs.append((ledger_field(epoch, slot), DONE))
        elif remap[slot][1]:
            pairs.append((ledger_field(epoch, slot), str(remap[slot][1])))
    return pairs, {slot: int(unit[0]) for slot, unit in enumerate(remap)}
