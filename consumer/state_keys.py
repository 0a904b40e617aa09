"""The keys of a trainer's checkpoint state (``ServerDataStream.state_dict()``), once.

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
                  every shard is one batch and epochs are yielded in plan order, so
                  after the same number of batches every rank's local position is the
                  same; any rank (or a new world, re-split) resumes from it, so a
                  checkpoint that keeps rank 0's state only resumes the whole job
  and a state re-split for another number of ranks (consumer/rank_state.py) adds:
    remap         slot -> [shard, batches had]: what each slot of the resumed epoch builds
  a group of a run read by several groups (``group=``) adds:
    group         its name (a state of another group is refused)
  and once ``set_params`` was called:
    params        the run's change log of producer parameters, a list of entries
                  {version, index, id, params} (batchq/protocol/params_log.py): a resume
                  writes it back, so the resumed stream is the same even if Redis lost
                  the queue
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "CONSUMED_KEY",
    "DONE_KEY",
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
    "RUN_KEY",
    "SHARDS_KEY",
    "STATE_VERSION",
    "STEP_KEY",
    "VERSION_KEY",
    "WORLD_SIZE_KEY",
    "position_state",
    "rank_fields",
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
REMAP_KEY = "remap"
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
