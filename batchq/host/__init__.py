"""The host's processes: child processes, the embedded redis-server, the worker pool.

Child processes in their own process groups, spawned or forked from a warm process
(``procs``), the embedded redis-server and its binary (``embedded``), the pool of
``serve --workers``: its workers kept and sized (``pool``) by its autoscaling rule
(``autoscale``). Imported by the CLI, the tests and the benchmarks, never by the
producer or the trainer.
"""
