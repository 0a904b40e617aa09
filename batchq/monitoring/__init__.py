"""Monitoring: a queue read in one round trip and turned into figures.

The snapshot (``snapshot``), status rows (``rows``), their text (``text``), verdicts
(``verdict``), sizing (``sizing``), per-rank rows (``rank_rows``) and the Prometheus
exporter (``exporter``). Imported by the CLI, never by the producer or the trainer.
"""
