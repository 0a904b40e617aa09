"""Monitoring: a queue read in one round trip and turned into figures.

The snapshot (``snapshot``; its ranks' and groups': ``reader_snapshots``), status rows
(``rows``; the fields read from the counters and figures, the producers among them:
``counters``; the ranks and groups: ``reader_rows``), their text (``text``), verdicts
(``verdict``), sizing (``sizing``) and the Prometheus exporter (``exporter``; its
families: ``metric_families``). Imported by the CLI, never by the producer or the
trainer.
"""
