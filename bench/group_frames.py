"""A frame for several groups: duplicated inside each group's list, or stored once by
reference and released by each reader (issue 31's choice for frames below
``inline_max_bytes``, measured).

One client drives a run of ``--groups`` groups through the real scripts on a private
redis-server, one frame at a time: lease.lua, then either push.lua with the frame
itself (Redis keeps one copy per list) or a SET of the frame and push.lua with its
reference (one copy, a count of readers), then every group's reader: an RPOP of its
list, and for a reference the GET and release.lua in one round trip. Printed per frame
size: microseconds of wall time and of Redis CPU per frame delivered to a group, and
Redis' memory per frame held in every list, for both ways.

    python bench/group_frames.py [--groups 4] [--frames 2000]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import redis

from batchq.client.connection import make_client
from batchq.host.embedded import EmbeddedRedis
from batchq.protocol.calls import round_trip
from batchq.protocol.keys import QueueKeys
from batchq.protocol.layout import lease_entry
from batchq.protocol.producer_scripts import join, lease_call, push_call
from batchq.protocol.trainer_scripts import ClaimReply, claim, release_call
from batchq.wire.frame import decode_ref, encode_ref

SIZES = (4 * 1024, 16 * 1024, 64 * 1024, 256 * 1024)
TTL_MS = 60_000


def setup(client: redis.Redis, queue: str, groups: int) -> tuple[QueueKeys, str, str]:
    """A run of ``groups`` groups (their claims) and one producer: (keys, incarnation, run)."""
    keys = QueueKeys(queue)
    reply: ClaimReply | None = None
    for i in range(groups):
        n = int(client.hget(keys.meta, "groups") or 0)
        reply = claim(
            client, keys, op="acquire", token=f"t{i}", claim_ttl_ms=TTL_MS, run_id="run",
            new_incarnation="inc", takeover_run="", version="1", group=f"g{i}", rank=0,
            world=1, even="pad", resumed="", incarnation="", groups=n, key_world=1,
            max_lag=None, slot=0,
        )  # fmt: skip
    join(
        client, keys, producer="p", fingerprint="fp", hwm=10**6, shards=10**6, window=10**6,
        new_run="x", new_incarnation="x", heartbeat_ttl_ms=TTL_MS, version="1",
        epoch_batches=10**6, age_ms=0, no_create=False,
    )  # fmt: skip
    assert reply is not None
    return keys, reply.incarnation, reply.run


def measure(client: redis.Redis, groups: int, size: int, frames: int, by_ref: bool) -> dict:
    """Wall and Redis CPU per delivered frame, and memory per frame held, one way."""
    queue = f"gf-{size}-{int(by_ref)}-{time.monotonic_ns()}"
    keys, inc, run = setup(client, queue, groups)
    payload = os.urandom(size)
    lists = [keys.slot_view(i).data for i in range(groups)]
    info = client.info()
    cpu0 = float(info["used_cpu_sys"]) + float(info["used_cpu_user"])
    mem0 = int(info["used_memory"])
    t0 = time.perf_counter()
    held_mem = 0
    for n in range(frames):
        token = f"t{n}"
        lease = lease_call(
            keys, incarnation=inc, run=run, producer="p", token=token, heartbeat_ttl_ms=TTL_MS,
            prefetch=0, groups=groups, world=1,
        ).run(client)  # fmt: skip
        frame = keys.frame(run, "p", n) if by_ref else None
        push = push_call(
            keys, targets=lease.mask, rank=0, world=1, groups=groups, frame_key=frame,
            incarnation=inc, run=run, producer="p",
            entry=lease_entry(lease.g, run, token, lease.mask),
            element=encode_ref(frame) if frame else payload, last=True,
            heartbeat_ttl_ms=TTL_MS, frame_bytes=size, blocked_ms=0, produce_ms=0,
        )  # fmt: skip
        commands = [("SET", frame, payload, "PX", TTL_MS)] if frame else []
        round_trip(client, [*commands, push.command()], "pushing")
        if n == frames // 2:  # memory with one frame in every list
            held_mem = int(client.info("memory")["used_memory"]) - mem0
        for data in lists:
            element = client.rpop(data)
            if frame:
                name = decode_ref(element, keys.frame_prefix)
                round_trip(client, [("GET", name), release_call(keys, [name]).command()], "get")
    wall = time.perf_counter() - t0
    info = client.info()
    cpu = float(info["used_cpu_sys"]) + float(info["used_cpu_user"]) - cpu0
    client.delete(*client.keys(keys.pattern))
    delivered = frames * groups
    return {"wall_us": 1e6 * wall / delivered, "redis_us": 1e6 * cpu / delivered, "mem": held_mem}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--frames", type=int, default=2000)
    args = parser.parse_args()
    server = EmbeddedRedis()
    server.start()
    client = make_client(server.url)
    try:
        print(f"{args.groups} groups, {args.frames} frames each way and size; per delivered frame:")
        for size in SIZES:
            frames = max(200, args.frames * 16 * 1024 // max(size, 16 * 1024))
            got = {way: measure(client, args.groups, size, frames, way) for way in (False, True)}
            inline, ref = got[False], got[True]
            print(
                f"  {size // 1024:4d} KiB: inline {inline['wall_us']:7.1f} us wall, "
                f"{inline['redis_us']:6.1f} us Redis; by reference {ref['wall_us']:7.1f} us "
                f"wall, {ref['redis_us']:6.1f} us Redis; memory of one frame in every list "
                f"inline {inline['mem'] / 1024:.0f} KiB, by reference {ref['mem'] / 1024:.0f} KiB"
            )
    finally:
        client.close()
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
