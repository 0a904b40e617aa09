"""The Redis client: connections and the one boundary where redis-py errors become batchq's.

Clients, URLs and the backoff (``connection``), the hot path's held connection (``held``),
queue administration (``admin``) and work recovery (``reaper``).
"""
