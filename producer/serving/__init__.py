"""The serving loop's parts, kept apart from Fuel's API modules (which keep Fuel's names).

The shard plan (``sharding``, ``alignment``); a producer's membership of the run
(``membership``: join and leave; ``position``: the run served); building and pushing a
shard (``pushing``: the shard; ``frames``: its frames' headers; ``frame_push``: one
frame's element, round trip and replies; ``settings``: what the pushes carry); the
heartbeat thread (``heartbeat``); leases held ahead and the next shard built
(``ahead``); a blocked push's wait and hand-back (``blocking``); the transports
(``transport``, ``shm_pool``).
"""
