"""The host's processes: process groups, the embedded redis-server, the worker pool.

Process groups (``procs``), the embedded redis-server (``embedded``; its binary and
version: ``redis_binary``), the pool of
``serve --workers`` (``pool``) and its autoscaling rule (``autoscale``). Imported by the
CLI, the tests and the benchmarks, never by the producer or the trainer.
"""
