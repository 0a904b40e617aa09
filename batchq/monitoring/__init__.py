"""Monitoring: a queue read in one round trip and turned into figures.

The snapshot (``snapshot``), status rows (``rows``; the fields read from the stats and
trainer hashes: ``counters``; the producers: ``producer_rows``; the ranks:
``rank_rows``), their text (``text``), verdicts (``verdict``), sizing (``sizing``) and
the Prometheus exporter (``exporter``; its families: ``metric_families``). Imported by
the CLI, never by the producer or the trainer.
"""
