"""The serving loop's parts, kept apart from Fuel's API modules (which keep Fuel's names).

The shard plan (``sharding``, ``alignment``), building and pushing a shard (``pushing``),
the heartbeat thread (``heartbeat``), leases held ahead (``ahead``), a blocked push's wait
(``blocking``) and the transports (``transport``, ``shm_pool``).
"""
