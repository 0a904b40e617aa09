"""The host's processes: process groups, the embedded redis-server, the worker pool.

Process groups (``procs``), the embedded redis-server (``embedded``; its binary and
version: ``redis_binary``), the pool of
``serve --workers`` (``pool``), its autoscaling rule (``autoscale``), its workers forked
from the warm pool (``forked``) and kept (``keeper``: killed ones replaced). Imported by the
CLI, the tests and the benchmarks, never by the producer or the trainer.
"""
