"""Monitoring: a queue read in one round trip and turned into figures.

The snapshot (``snapshot``; its ranks' and groups': ``reader_snapshots``), status rows
(``rows``; the fields read from the counters and figures, the producers among them:
``counters``; the ranks and groups: ``reader_rows``), their text (``text``), verdicts
(``verdict``), sizing (``sizing``) and the Prometheus exporter (``exporter``; its
families: ``metric_families``). Imported by the CLI, never by the producer or the
trainer.
"""

__all__ = ["STATUS_SCHEMA_VERSION"]

#: The version of the status rows' layout (``status --json``, ``top --once --json``),
#: documented field by field in :mod:`batchq.monitoring.rows`, which re-exports it. It
#: lives here so that the CLI's help can name it without importing the readers.
STATUS_SCHEMA_VERSION = 6
