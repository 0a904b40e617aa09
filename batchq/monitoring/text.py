"""The status rows as text: the table of ``batchq status``, each queue's details, the
number formats ``top`` shares, and text columns (the CLI's other tables too). Rows come
from :mod:`batchq.monitoring.rows`; this reads their fields and computes nothing.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

__all__ = [
    "cache_lines",
    "columns",
    "fmt_age",
    "fmt_bytes",
    "fmt_epoch",
    "fmt_pct",
    "quarantine_line",
    "render_table",
]


def columns(table: Sequence[Sequence[str]]) -> list[str]:
    """The lines of ``table`` (the header first) as left-aligned columns two spaces
    apart."""
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    return [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in table
    ]


def fmt_bytes(n: float | None) -> str:
    """1234567 -> '1.2 MB' (decimal units)."""
    if n is None:
        return "-"
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"  # pragma: no cover - the loop returns


def fmt_age(seconds: float | None) -> str:
    """0.0123 -> '12 ms', 75 -> '1.2 min'; None -> '-'."""
    if seconds is None:
        return "-"
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 60:
        return f"{seconds:.1f} s"
    if seconds < 3600:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def fmt_pct(fraction: float | None) -> str:
    """0.423 -> '42%'; None -> '-'."""
    return "-" if fraction is None else f"{100 * fraction:.0f}%"


def fmt_epoch(row: dict[str, Any]) -> str:
    """'3 45%' (epoch and its progress), '3' without a size, '-' before the first."""
    if row["epoch"] is None:
        return "-"
    if row["epoch_fraction"] is None:
        return str(row["epoch"])
    return f"{row['epoch']} {fmt_pct(min(1.0, row['epoch_fraction']))}"


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}/s"


def _trainer_lines(r: dict[str, Any]) -> list[str]:
    if r["trainer_batches_per_s"] is None:
        return []
    waits = "/".join(
        f"{1000 * (r[k] or 0):.0f}" for k in ("wait_p50_s", "wait_p90_s", "wait_p99_s")
    )
    return [
        f"  trainer: {r['trainer_batches_per_s']:.1f} batches/s, "
        f"{r['trainer_mb_per_s'] or 0:.1f} MB/s, stall {fmt_pct(r['stall'])} "
        f"(epoch {fmt_pct(r['stall_epoch'])}), wait p50/p90/p99 {waits} ms "
        f"(figures {fmt_age(r['figures_age_s'])} old)"
    ]


def _sizing_lines(r: dict[str, Any]) -> list[str]:
    if r["recommended_producers"] is None:
        return []
    return [
        f"  sizing: demand {r['demand_batches_per_s']:.1f} batches/s "
        f"({r['busy_ms_per_batch']:.1f} ms of work per batch), supply "
        f"{_rate(r['supply_batches_per_s'])} built, {_rate(r['delivered_batches_per_s'])}"
        f" delivered; {r['producer_batches_per_s']:.1f} per producer: recommend "
        f"{r['recommended_producers']} producers (now {r['producers_alive']})"
    ]


def _autoscale_lines(r: dict[str, Any]) -> list[str]:
    last = r["autoscale_last"]
    if not (r["autoscalers"] or last):
        return []
    line = (
        f"  autoscale: {r['autoscalers']} autoscaler(s), {r['autoscale_added']} added, "
        f"{r['autoscale_retired']} retired"
    )
    if last:
        line += (
            f"; last {last.get('action')} {last.get('count')} -> {last.get('workers')} "
            f"({last.get('reason')})"
        )
    return [line]


def _producer_lines(r: dict[str, Any], max_producers: int) -> list[str]:
    lines = []
    for p in r["producers"][:max_producers]:
        rate = "-" if p["batches_per_s"] is None else f"{p['batches_per_s']:.1f}"
        lines.append(
            f"  producer {p['id']}: {p['batches']} batches, builds {rate} batches/s, "
            f"blocked {fmt_pct(p['blocked_fraction'])}"
            + (
                ""
                if p["cache_hits"] is None
                else f", cache hits {fmt_pct(p['cache_hit_rate'])} ({fmt_bytes(p['cache_bytes'])})"
            )
        )
    if len(r["producers"]) > max_producers:
        lines.append(f"  ... and {len(r['producers']) - max_producers} more producers")
    return lines


def cache_lines(figures: dict[str, Any]) -> list[str]:
    """The cache's line (``status``, ``report``): hit rate, bytes held, build time saved
    in all and per batch pushed; none when no producer caches.

    Args:
        figures: the cache fields of a status row, or
            :func:`batchq.monitoring.counters.cache_since_created`'s.
    """
    if figures["cache_hits"] is None:
        return []
    per = figures["cache_saved_ms_per_batch"]
    per_batch = "" if per is None else f" ({per:.1f} ms per batch)"
    return [
        f"  cache: hits {fmt_pct(figures['cache_hit_rate'])} ({figures['cache_hits']} of "
        f"{figures['cache_hits'] + figures['cache_misses']} examples), "
        f"{fmt_bytes(figures['cache_bytes'])} held, "
        f"build time saved {fmt_age(figures['cache_saved_s'])}{per_batch}"
    ]


def quarantine_line(quarantined: int, run_count: int, run: str) -> str:
    """The quarantined examples' line (``status``, ``report``).

    Args:
        quarantined: the examples counted since the queue's keys were created.
        run_count: those of the run ``run``.
        run: the run's id.
    """
    return (
        f"  quarantined examples: {run_count} in run {run or '-'}, {quarantined} since the "
        "keys were created (replaced by substitutes; `batchq dead` lists them)"
    )


def _dead_lines(r: dict[str, Any]) -> list[str]:
    quarantined = r.get("quarantined", 0)
    if quarantined:
        return [
            quarantine_line(quarantined, r["quarantined_run"], r["run"]),
            *_dead_lines({**r, "quarantined": 0}),
        ]
    if not r["dead_by_reason"]:
        return []
    return ["  dead frames: " + ", ".join(f"{k} {v}" for k, v in r["dead_by_reason"].items())]


def _rank_lines(r: dict[str, Any]) -> list[str]:
    lines = []
    for rank in r.get("ranks", []):
        mark = " (slowest)" if rank["rank"] == r.get("slowest_rank") else ""
        rate = "-" if rank["batches_per_s"] is None else f"{rank['batches_per_s']:.1f}/s"
        epoch = "-" if rank["epoch"] is None else f"{rank['epoch']}:{rank['epoch_progress']}"
        lines.append(
            f"  rank {rank['rank']}{mark}: {rank['verdict']}, depth {rank['depth']}/{r['hwm']}, "
            f"stall {fmt_pct(rank['stall'])}, {rate}, epoch {epoch}, {rank['trainer']}"
        )
    return lines


def _group_lines(r: dict[str, Any]) -> list[str]:
    """One line per group of a run read by several groups."""
    lines = []
    for g in r.get("groups", []):
        name = g["group"] or "(default)"
        mark = " (slowest)" if g["group"] == r.get("slowest_group") else ""
        epoch = "-" if g["epoch"] is None else f"{g['epoch']}:{g['epoch_progress']}"
        alone = (
            f", detached: built for it alone ({g['solo_builds']} so far)"
            if g["sharing"] == "alone"
            else ""
        )
        lines.append(
            f"  group {name}{mark}: {g['verdict']}, depth {g['depth']}/{r['hwm']}, "
            f"stall {fmt_pct(g['stall'])}, {_rate(g['batches_per_s'])}, epoch {epoch}, "
            f"{g['lag_batches']:.0f} behind, {g['trainer']}{alone}"
        )
    return lines


def _params_lines(r: dict[str, Any]) -> list[str]:
    """The run's look-ahead (set_params' default distance) and its params log."""
    if r.get("lookahead_batches") is None:
        return []
    line = f"  look-ahead: {r['lookahead_batches']} batches (set_params applies this far ahead)"
    if r.get("params_version") or r.get("rebuilt_params"):
        line += (
            f"; params log version {r['params_version']}, {r['rebuilt_params']} frames "
            "rebuilt after a change"
        )
    return [line]


def _host_lines(r: dict[str, Any]) -> list[str]:
    """This host's shared memory and the run id."""
    lines = []
    if r["shm_segments"]:
        lines.append(
            f"  shared memory here: {r['shm_segments']} segments, {fmt_bytes(r['shm_bytes'])}"
        )
    if r["run"]:
        lines.append(f"  run {r['run']}" + (f" on {r['node']}" if r.get("node") else ""))
    return lines


def _stripe_lines(r: dict[str, Any]) -> list[str]:
    """A striped queue's stripes: where each is, and what went through it."""
    stripes = r.get("stripes") or []
    if not stripes:
        return []
    lines = [f"  {len(stripes)} stripes (the figures above are stripe 0's):"]
    for s in stripes:
        lines.append(
            f"    stripe {s['stripe']} {s['queue']} on {s['node']}: depth {s['depth']}/"
            f"{r['hwm']}, pushed {s['pushed']}, popped {s['popped']}, "
            f"{s['producers_alive']} producers"
        )
    return lines


def _details(r: dict[str, Any], max_producers: int = 8) -> list[str]:
    """A queue's lines under the table: its verdict, then what it has of each part."""
    return [
        f"{r['queue']}: {r['verdict'].upper()}: {r['verdict_reason']}",
        *_trainer_lines(r),
        *_sizing_lines(r),
        *_autoscale_lines(r),
        *_producer_lines(r, max_producers),
        *cache_lines(r),
        *_dead_lines(r),
        *_rank_lines(r),
        *_group_lines(r),
        *_stripe_lines(r),
        *_params_lines(r),
        *_host_lines(r),
    ]


def render_table(rows: list[dict[str, Any]], *, as_json: bool = False) -> str:
    """Render status rows as a readable table with a verdict per queue, or as JSON."""
    if as_json:
        return json.dumps(rows, indent=2)
    if not rows:
        return "no queues on this server"
    headers = (
        "QUEUE", "DEPTH/HWM", "PRODUCERS", "NEED", "LEASES", "HELD", "OLDEST", "STALL", "EPOCH",
        "SERVED", "TRAINER", "DEAD",
    )  # fmt: skip
    table = [headers]
    for r in rows:
        table.append(
            (
                r["queue"],
                f"{r['depth']}/{r['hwm']}",
                str(r["producers_alive"]),
                "-" if r["recommended_producers"] is None else str(r["recommended_producers"]),
                str(r["leases"]),
                fmt_bytes(r["bytes_held"]),
                fmt_age(r["oldest_age_s"]),
                fmt_pct(r["stall"]),
                fmt_epoch(r),
                str(r["pushed"]),
                r["trainer"],
                str(r["dead"]),
            )
        )
    lines = columns(table)
    for r in rows:
        lines.append("")
        lines.extend(_details(r))
    return "\n".join(lines)
