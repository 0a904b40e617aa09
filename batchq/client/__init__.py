"""The Redis client: connections and the one boundary where redis-py errors become batchq's.

Clients, redis-py errors -> batchq errors and the backoff (``connection``), the URL forms
(``urls``), Redis Cluster: where a queue's slot lives (``cluster``) and the commands it
refused sent again (``redirects``), Sentinel (``sentinel``) and all batchq takes from
redis-py's internals, the hot path's held connection among them (``redis_internals``).
"""
