"""A producer's transport and a trainer's shared memory over one folder (fakeredis meta)."""

from __future__ import annotations

from pathlib import Path

import fakeredis

from batchq.protocol.keys import QueueKeys
from consumer.reader.shm_frames import TrainerShm
from producer.serving.membership import RunPosition
from producer.serving.transport import Transport


def shm_pair(
    folder: Path, client: fakeredis.FakeRedis, segments: int, run: str = "ab12"
) -> tuple[Transport, TrainerShm]:
    """A trainer that published this host, and a producer of ``segments`` segments that
    joined ``run`` and writes into shared memory."""
    keys = QueueKeys("q")
    trainer = TrainerShm(keys, "auto", str(folder))
    trainer.publish(client, 10)
    producer = Transport("auto", str(folder), keys, "p", segments)
    producer.joined(client, RunPosition(run))
    if not producer.active:
        raise RuntimeError("the producer does not see the trainer's host")
    return producer, trainer
