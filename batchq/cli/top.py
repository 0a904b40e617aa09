"""The queues watched until stopped: ``batchq top`` (live, with sparklines of depth and
stall; rich) and ``batchq exporter`` (a Prometheus endpoint, until SIGTERM/SIGINT, exit 0;
the collector: :mod:`batchq.monitoring.exporter`).

Each refresh reads every queue shown in one round trip (:func:`batchq.monitoring.rows.status_rows`
underneath) and appends this read's depth and the trainer's stall to the sparklines,
which start from the trainer's history list (one sample a second) the first time a queue
is seen. Frame rates in and out (and each producer's push rate) are the differences of the
counters between two refreshes, over the Redis server's clock; on the first screen (and
with ``--once``) the rates in and out come from the stored history instead (frames
pushed and batches taken over its last :data:`batchq.monitoring.verdict.RECENT_S` seconds, by the
trainer's clock), so they show at once. A producer's build rate is its batches per
second of pipeline time (see :mod:`batchq.monitoring.rows`); the producers line shows what the
pool needs (:mod:`batchq.monitoring.sizing`).

``top --once --json`` prints that one read as JSON instead of the screen: a list of the
rows of ``status --json`` (:mod:`batchq.monitoring.rows`, the same schema and fields in
the same order), each with four fields added at its end: ``rate_in`` and ``rate_out``
(float|null, frames/s, from the stored history as on the first screen),
``depth_series`` and ``stall_series`` (lists of floats, oldest first, at most
:data:`SPARK_WIDTH`: the sparklines' samples, this read's depth last). A producer's
push rate needs two reads, so it is not there. ``--json`` without ``--once`` is refused:
the live screen is redrawn in place, never printed.
"""

from __future__ import annotations

import argparse
import json
import signal
import time
from collections import deque
from collections.abc import Iterable
from typing import Any

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.panel import Panel
from rich.text import Text

from batchq.client.connection import (
    StopEvent,
    call,
    describe_url,
    make_client,
    redis_errors,
    resolve_url,
)
from batchq.errors import BatchQueueError, ConfigError
from batchq.monitoring.rows import list_queues, require_queue, row_from_snapshot
from batchq.monitoring.sizing import recent_samples
from batchq.monitoring.snapshot import QueueSnapshot, read_snapshots
from batchq.monitoring.text import fmt_age, fmt_bytes, fmt_pct
from batchq.monitoring.verdict import RECENT_S
from batchq.protocol.fields import HistoryField as H
from batchq.protocol.keys import check_name

__all__ = [
    "SPARK_WIDTH",
    "TopState",
    "render_top",
    "run_exporter",
    "run_top",
    "sparkline",
    "top_json",
]

#: Samples (characters) per sparkline.
SPARK_WIDTH = 24
_BARS = "▁▂▃▄▅▆▇█"
_STYLE = {
    "input-bound": "bold red",
    "trainer-bound": "bold green",
    "balanced": "bold cyan",
    "idle": "dim",
    "unknown": "yellow",
    "unread": "bold magenta",  # a rank's share goes unread (batchq.monitoring.reader_rows)
}
_MAX_PRODUCERS = 3


def sparkline(values: Iterable[float], top: float, width: int = SPARK_WIDTH) -> str:
    """Draw the last ``width`` values as bars, padded on the left.

    Args:
        values: the samples, oldest first.
        top: the value of a full bar (<= 0: the largest sample).
        width: characters.

    Returns:
        A string of exactly ``width`` characters.
    """
    vals = list(values)[-width:]
    if top <= 0:
        top = max(vals, default=0.0) or 1.0
    bars = "".join(
        _BARS[min(len(_BARS) - 1, max(0, round(v / top * (len(_BARS) - 1))))] for v in vals
    )
    return bars.rjust(width)


class TopState:
    """What top remembers between refreshes: sparkline samples and the last counters."""

    def __init__(self, width: int = SPARK_WIDTH) -> None:
        self.width = width
        self.depth: dict[str, deque[float]] = {}
        self.stall: dict[str, deque[float]] = {}
        self._last: dict[str, tuple[int, int, int]] = {}  # queue -> (now_ms, pushed, popped)
        self._pushed: dict[tuple[str, str], int] = {}  # (queue, producer) -> frames pushed

    def update(self, snaps: list[QueueSnapshot]) -> list[dict[str, Any]]:
        """Turn one read into rows (status rows plus ``rate_in``/``rate_out``), remembering
        its samples."""
        rows = []
        for snap in snaps:
            row = row_from_snapshot(snap)
            self._sparklines(snap, row)
            dt = self._queue_rates(snap, row)
            self._producer_rates(snap.queue, row, dt)
            rows.append(row)
        return rows

    def _sparklines(self, snap: QueueSnapshot, row: dict[str, Any]) -> None:
        """Append this read's depth and fresh stall (the first time: after the history)."""
        q = snap.queue
        if q not in self.depth:  # first sight: start from the trainer's history
            past = list(reversed(snap.history))
            self.depth[q] = deque((float(s.get(H.DEPTH, 0)) for s in past), self.width)
            self.stall[q] = deque((float(s.get(H.STALL, 0)) for s in past), self.width)
        self.depth[q].append(float(row["depth"]))  # a data-parallel run: all its lists
        if row["figures_fresh"] and row["stall"] is not None:
            self.stall[q].append(float(row["stall"]))

    def _queue_rates(self, snap: QueueSnapshot, row: dict[str, Any]) -> float:
        """Set the row's frame rates in and out; the seconds since the last read (0: the
        first, or the server's clock did not move)."""
        q = snap.queue
        row["rate_in"] = row["rate_out"] = None
        last = self._last.get(q)
        dt = (snap.now_ms - last[0]) / 1000 if last is not None else 0.0
        if last is not None and dt > 0:
            row["rate_in"] = max(0, row["pushed"] - last[1]) / dt
            row["rate_out"] = max(0, row["popped"] - last[2]) / dt
        elif last is None:  # first sight: the rates of the stored history
            row["rate_in"] = row["delivered_batches_per_s"]
            row["rate_out"] = _taken_rate(snap)
        self._last[q] = (snap.now_ms, row["pushed"], row["popped"])
        return dt

    def _producer_rates(self, q: str, row: dict[str, Any], dt: float) -> None:
        """Set each producer's push rate over the last ``dt`` seconds (None: no earlier read)."""
        for p in row["producers"]:
            before = self._pushed.get((q, p["id"]))
            p["rate"] = None
            if before is not None and dt > 0:
                p["rate"] = max(0, p["batches"] - before) / dt
            self._pushed[(q, p["id"])] = p["batches"]


def _taken_rate(snap: QueueSnapshot) -> float | None:
    """Batches the trainer took per second over its recent history samples."""
    samples = recent_samples(snap.history, snap.now_ms / 1000 - RECENT_S)
    if len(samples) < 2:
        return None
    new, old = samples[0], samples[-1]
    try:
        dt, db = float(new[H.T]) - float(old[H.T]), float(new[H.BATCHES]) - float(old[H.BATCHES])
    except (KeyError, TypeError, ValueError):
        return None
    return db / dt if dt > 0 and db >= 0 else None


def _rate(value: float | None, unit: str = "/s") -> str:
    return "-" if value is None else f"{value:.1f}{unit}"


def _panel(row: dict[str, Any], state: TopState) -> Panel:
    q, hwm = row["queue"], row["hwm"]
    depth = Text.assemble(
        ("depth ", "bold"),
        f"{row['depth']:>4}/{hwm:<4} ",
        (sparkline(state.depth.get(q, ()), float(hwm), state.width), "blue"),
        f"  held {fmt_bytes(row['bytes_held'])}, oldest {fmt_age(row['oldest_age_s'])}",
    )
    rate = _rate(row["trainer_batches_per_s"], " b/s")
    stall = Text.assemble(
        ("stall ", "bold"),
        f"{fmt_pct(row['stall']):>9} ",
        (sparkline(state.stall.get(q, ()), 1.0, state.width), "magenta"),
        f"  trainer {row['trainer']}, {rate}",
    )
    epoch = "-" if row["epoch"] is None else str(row["epoch"])
    if row["epoch_progress"] is not None and row["epoch_batches"]:
        epoch += f" ({row['epoch_progress']}/{row['epoch_batches']})"
    flow = Text(
        f"epoch {epoch}   in {_rate(row['rate_in'])} out {_rate(row['rate_out'])}   "
        f"leases {row['leases']}   dead {row['dead']}"
    )
    lines: list[Text] = [depth, stall, flow]
    producers = row["producers"]
    need = ""
    if row["recommended_producers"] is not None:
        need = (
            f", need {row['recommended_producers']} (demand "
            f"{row['demand_batches_per_s']:.1f} b/s, {row['producer_batches_per_s']:.1f} each)"
        )
    lines.append(
        Text(f"producers {len(producers)} alive{need}", style="bold" if producers else "red")
    )
    for p in producers[:_MAX_PRODUCERS]:
        build, pushes = _rate(p["batches_per_s"]), _rate(p.get("rate"))
        lines.append(
            Text(
                f"  {p['id'][:24]:<24} builds {build:>8}, pushes {pushes:>8}, "
                f"blocked {fmt_pct(p['blocked_fraction']):>4}"
            )
        )
    if len(producers) > _MAX_PRODUCERS:
        lines.append(Text(f"  ... {len(producers) - _MAX_PRODUCERS} more"))
    lines.append(Text(row["verdict_reason"], style="italic"))
    title = Text.assemble((q, "bold"), " ", (row["verdict"].upper(), _STYLE[row["verdict"]]))
    return Panel(Group(*lines), title=title, title_align="left", padding=(0, 1))


def render_top(
    rows: list[dict[str, Any]], state: TopState, *, where: str, error: str | None = None
) -> RenderableType:
    """One screen: a header line and a panel per queue.

    Args:
        rows: the rows :meth:`TopState.update` returned.
        state: the sparklines' samples.
        where: the Redis URL (password masked) for the header.
        error: a line to show in red (the last read failed).

    Returns:
        A rich renderable.
    """
    header = Text.assemble(
        ("batchq top", "bold"), f"  {where}  {time.strftime('%H:%M:%S')}  Ctrl-C quits"
    )
    parts: list[RenderableType] = [header]
    if error:
        parts.append(Text(error, style="bold red"))
    if not rows and not error:
        parts.append(Text("no queues on this server"))
    parts.extend(_panel(r, state) for r in rows)
    return Group(*parts)


def top_json(rows: list[dict[str, Any]], state: TopState) -> list[dict[str, Any]]:
    """The rows of one read as ``top --once --json`` prints them (see the module's
    docstring): status rows plus the rates and the sparklines' samples."""
    out = []
    for row in rows:
        q = row["queue"]
        producers = [{k: v for k, v in p.items() if k != "rate"} for p in row["producers"]]
        out.append(
            {
                **row,  # the status fields, then rate_in and rate_out (TopState.update)
                "producers": producers,
                "depth_series": list(state.depth.get(q, ())),
                "stall_series": list(state.stall.get(q, ())),
            }
        )
    return out


def _read(client: Any, queue: str | None, state: TopState, where: str) -> list[dict[str, Any]]:
    """One read of the queue (ConfigError if it does not exist) or of every queue."""
    if queue:
        require_queue(client, queue, where)
    names = [queue] if queue else list_queues(client)
    return state.update(read_snapshots(client, names, history=state.width))


def run_top(args: argparse.Namespace, console: Console | None = None) -> int:
    """Show the queues until Ctrl-C (or once, with ``--once``).

    Args:
        args: url, queue (None: every queue), interval (s), once, json (with once only).
        console: where to draw (default: the terminal).

    Returns:
        0 when quit.

    Raises:
        ConfigError: a bad --interval or --queue, or --json without --once; with
            ``--once``, a --queue that does not exist (live, top says so and reads
            again each refresh, until it does).
        ConnectionLost: with ``--once``, Redis could not be read (live, top retries).
    """
    if not args.interval > 0:
        raise ConfigError(f"--interval {args.interval!r} is not valid: expected > 0")
    if args.json and not args.once:
        raise ConfigError(
            "--json needs --once: the live screen is redrawn in place, never printed "
            "(top --once --json prints one read)"
        )
    queue = check_name(args.queue, "queue") if args.queue else None
    url = resolve_url(args.url)
    where = describe_url(url)
    client = make_client(url, socket_timeout_s=5.0)
    console = console or Console()
    state = TopState()
    try:
        if args.once:
            rows = call(
                lambda: _read(client, queue, state, where), f"reading queues at {where}", client
            )
            if args.json:
                print(json.dumps(top_json(rows, state), indent=2))
            else:
                console.print(render_top(rows, state, where=where))
            return 0
        rows, error = [], None
        with Live(console=console, screen=True, auto_refresh=False) as live:
            while True:
                try:
                    rows, error = _read(client, queue, state, where), None
                except redis_errors as e:
                    error = f"reading {where} failed: {e}; retrying"
                except BatchQueueError as e:  # e.g. no such queue (yet): shown, read again
                    rows, error = [], str(e)
                live.update(render_top(rows, state, where=where, error=error), refresh=True)
                time.sleep(args.interval)
    except KeyboardInterrupt:
        return 0
    finally:
        client.close()


_EXPORTER_MISSING = "batchq exporter needs prometheus-client: pip install 'batchq[exporter]'"


def run_exporter(args: argparse.Namespace) -> int:
    """Serve ``/metrics`` until SIGTERM or SIGINT; 0 when stopped by either."""
    try:
        from batchq.monitoring.exporter import start_exporter
    except ImportError as e:
        raise ConfigError(f"{_EXPORTER_MISSING} ({e})") from None
    queues = [check_name(q, "queue") for q in args.queue or []]
    url = resolve_url(args.url)
    client = make_client(url, socket_timeout_s=5.0)
    stop = StopEvent()  # set by a signal handler: threading.Event's set may deadlock there

    def _stop(_signum: int, _frame: Any) -> None:
        stop.set()

    previous = {sig: signal.signal(sig, _stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server = start_exporter(client, port=args.port, host=args.host, queues=queues)
        try:
            what = ", ".join(queues) if queues else "every queue"
            host = f"[{args.host}]" if ":" in args.host else args.host
            print(
                f"batchq exporter: serving http://{host}:{server.port}/metrics "
                f"({what} at {describe_url(url)})",
                flush=True,
            )
            while not stop.wait(1.0):
                pass
        finally:
            server.close()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        client.close()
    return 0
