"""The serving loop's parts, kept apart from Fuel's API modules (which keep Fuel's names).

The shard plan (``sharding``, ``alignment``); a producer's membership of the run
(``membership``: join and leave; ``position``: the run served and its cap); serving a
shard (``pushing``: its batches built and pushed, holding ``frame_push``: one frame's
element, round trip, replies and waits; ``frames``: the frames' headers and what the
pushes carry); the heartbeat thread (``heartbeat``); leases held ahead and the next
shard built (``ahead``); a blocked push's clock and hand-back
(``blocking``); the transports (``transport``, ``shm_pool``).
"""
