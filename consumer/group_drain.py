"""A group that finished before the others lets go of what its list still holds.

In a run read by several groups (:mod:`batchq.protocol.groups`) a frame stored by
reference is deleted by its last reader's release, and a shared-memory segment is reused
once every group it went to released it. A rank of a group that finished
(``close(finished=True)``) is no longer a target of any push (push.lua), but its list
may still hold frames pushed before (the window it read ahead): :func:`drain_group`
pops them and releases each, so that the other groups' frames and segments are not held
until the run ends. A trainer killed before it drains leaves that to the run's end
(every frame and segment of the queue goes then).
"""

from __future__ import annotations

import logging
from typing import Any

import redis

from batchq.client.connection import retrying
from batchq.errors import FrameError
from batchq.protocol import trainer_scripts
from batchq.protocol.calls import round_trip
from batchq.protocol.keys import QueueKeys
from batchq.wire.frame import decode_ref, is_ref
from batchq.wire.shm import is_descriptor
from consumer.reader.shm_frames import TrainerShm

__all__ = ["DRAIN_CHUNK", "drain_group"]

log = logging.getLogger(__name__)

DRAIN_CHUNK = 256  # elements popped per round trip


def drain_group(
    client: redis.Redis, keys: QueueKeys, data_key: str, shm: TrainerShm, timeout_s: float
) -> int:
    """Pop everything left in ``data_key`` (a finished group rank's list) and release
    it: references through release.lua, shared-memory descriptors through their
    segments' release words; returns how many elements went."""
    drained = 0
    while True:

        def pop() -> Any:
            return client.rpop(data_key, DRAIN_CHUNK)

        elements = retrying(pop, f"draining {data_key}", timeout_s, client=client) or []
        if not elements:
            break
        drained += len(elements)
        names: list[str] = []
        for element in elements:
            if is_descriptor(element):
                shm.release_unread(element)
            elif is_ref(element):
                try:
                    names.append(decode_ref(element, keys.frame_prefix))
                except FrameError:
                    continue  # not this queue's: nothing of ours to release
        if names:
            call = trainer_scripts.release_call(keys, names)

            def release(call: Any = call) -> Any:
                return round_trip(client, [call.command()], "releasing frames")

            retrying(release, f"releasing frames ({keys.queue})", timeout_s, client=client)
    if drained:
        log.info("queue %s: %d element(s) left in %s released", keys.queue, drained, data_key)
    return drained
