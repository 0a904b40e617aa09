"""The Redis client: connections and the one boundary where redis-py errors become batchq's.

Clients, redis-py errors -> batchq errors and the backoff (``connection``), the URL forms
(``urls``), Redis Cluster: where a queue's slot lives (``cluster``) and the commands it
refused sent again (``redirects``), Sentinel (``sentinel``), the hot path's held
connection (``held``) and all batchq takes from redis-py's internals
(``redis_internals``).
"""
