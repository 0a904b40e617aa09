"""``batchq report --queue Q --out report.png``: depth, stall and throughput over the run.

The samples come from the queue's history list: the trainer pushes one a second while it
runs (depth before its pop, batches so far, recent stall fraction, batches/s, MB/s,
and, added by the pop script, the producers alive, frames pushed and the live
producers' build totals), newest first, the last hour. Four plots share the time axis:
depth; the trainer's stall; throughput, with the trainer's demand (batches/s it would
take if it never waited) against the producers' supply (their count times the rate of
one, between consecutive samples) and what was delivered (frames pushed per second);
and the producers alive, with joins (+n) and leaves (-n) marked, and faint vertical
lines at them on every plot. Needs matplotlib (``pip install 'batchq[report]'``); only
its object-oriented API is used (no pyplot, no display needed).

Under the picture's path it prints what the history samples do not carry (they are the
trainer's and pop.lua's, with no cache or quarantine figure, so these are not plotted
over time): the examples quarantined (the run's, from its quarantine hash, and the
queue's counter) and the producers' cache figures (hit rate, bytes held, build time
saved in all and per batch), summed over every producer in the pstats hash, those gone
too (:func:`batchq.monitoring.counters.cache_since_created`): a report is drawn after
the run, when its producers have stopped.

With ``--json`` it prints, instead of those lines, one JSON object (the picture is
written all the same), with these fields in this order::

    queue             str         the queue's name
    out               str         the picture's path
    samples           int         history samples plotted (rank 0's, group slot 0's)
    span_s            float       seconds from the first sample to the last
    mean_stall        float       the trainer's stall fraction, averaged over the samples
    hwm               int         the run's cap (0: unknown)
    world_size        int         the trainer's ranks (1: a single trainer)
    groups            list        the names of the groups reading the run ([]: one)
    run               str         the run id ('' if none)
    quarantined       int         examples quarantined since the keys were created
    quarantined_run   int         those of the run ``run``
    cache_hits        int|null    the cache figures of every producer in pstats, gone
    cache_misses      int|null    ones too, as in the lines
    cache_hit_rate    float|null  (:func:`batchq.monitoring.counters.cache_since_created`;
    cache_bytes       int|null    the meanings of the status row's fields of these names;
    cache_saved_s     float|null  null: no producer caches)
    cache_saved_ms_per_batch float|null
    series            object      per sample, oldest first, lists of one value a sample
                                  (null where the sample lacks it): t (seconds since
                                  the first sample), depth, stall, batches_per_s,
                                  mb_per_s, producers, demand, supply, delivered (the
                                  plots' lines; see :func:`sizing_series`)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from batchq.client.connection import call, describe_url, make_client, resolve_url
from batchq.errors import ConfigError
from batchq.monitoring.counters import cache_since_created, quarantined_in_run
from batchq.monitoring.sizing import delivered_rate, demand_rate, sample_rate
from batchq.monitoring.snapshot import read_snapshots
from batchq.monitoring.text import cache_lines, quarantine_line
from batchq.protocol.fields import HistoryField as H
from batchq.protocol.fields import MetaField, StatsField
from batchq.protocol.keys import QueueKeys, check_name
from batchq.protocol.words import as_text

__all__ = [
    "MISSING",
    "load_history",
    "plot_report",
    "report_json",
    "run_report",
    "sizing_series",
    "summary_figures",
    "summary_lines",
]

MISSING = "batchq report needs matplotlib: pip install 'batchq[report]'"


def _require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        raise ConfigError(f"{MISSING} ({e})") from None


def load_history(
    client: Any, queue: str, rank: int = 0, world: int = 1, slot: int = 0
) -> list[dict[str, Any]]:
    """The queue's history samples (a data-parallel trainer's: those of one rank; a run
    read by several groups: those of group slot ``slot``), oldest first (malformed ones
    skipped)."""
    raw = client.lrange(QueueKeys(queue).slot_view(slot).history_of(rank, world), 0, -1)
    samples = []
    for item in reversed(raw):
        try:
            sample = json.loads(item)
        except ValueError:
            continue
        if isinstance(sample, dict) and isinstance(sample.get(H.T), int | float):
            samples.append(sample)
    return samples


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _demand(s: dict[str, Any]) -> float | None:
    """The trainer's demand at sample ``s`` (None: the sample lacks its figures)."""
    rate, stall = s.get(H.BATCHES_PER_S), s.get(H.STALL)
    return demand_rate(rate, stall) if _is_number(rate) and _is_number(stall) else None


def _step(
    s: dict[str, Any], prev: dict[str, Any], n: float | None
) -> tuple[float | None, float | None, float | None]:
    """(supply, delivered, change in the producer count) from ``prev`` to ``s``, which
    has ``n`` producers."""
    rate = sample_rate([s, prev])
    supply = rate * n if rate is not None and n is not None else None
    pn = prev.get(H.PRODUCERS)
    change = n - pn if n is not None and isinstance(pn, int | float) and n != pn else None
    return supply, delivered_rate([s, prev]), change


def sizing_series(samples: list[dict[str, Any]]) -> dict[str, list[float | None]]:
    """Per sample (oldest first): producers, demand, supply, delivered, and changes.

    ``change`` is the change in the producer count since the previous sample (joins
    positive, leaves negative); a figure a sample cannot give (samples written before
    the pop script added the queue side, the first sample's rates) is None.
    """
    out: dict[str, list[float | None]] = {
        k: [] for k in ("producers", "demand", "supply", "delivered", "change")
    }
    prev: dict[str, Any] | None = None
    for s in samples:
        n = s.get(H.PRODUCERS)
        n = float(n) if isinstance(n, int | float) else None
        supply, delivered, change = (None, None, None) if prev is None else _step(s, prev, n)
        out["producers"].append(n)
        out["demand"].append(_demand(s))
        out["supply"].append(supply)
        out["delivered"].append(delivered)
        out["change"].append(change)
        prev = s
    return out


def _mark_changes(axes: list[Any], t: list[float], change: list[float | None]) -> None:
    for x, c in zip(t, change, strict=True):
        if c:
            for ax in axes:
                ax.axvline(x, color="tab:olive" if c > 0 else "tab:brown", alpha=0.35, lw=0.8)


def _series(samples: list[dict[str, Any]], name: str, scale: float = 1.0) -> list[float]:
    """A sample field's values (absent: 0) times ``scale``."""
    return [float(s.get(name, 0) or 0) * scale for s in samples]


def _gaps(values: list[float | None]) -> list[float]:
    """None as NaN: matplotlib leaves a gap there."""
    return [float("nan") if v is None else v for v in values]


def _plot_ranks(
    axes: tuple[Any, Any, Any], ranks: dict[str, list[dict[str, Any]]], t0: float
) -> None:
    """A line per rank (or per group) on the depth, stall and rate plots, each labelled
    with its key."""
    depth_ax, stall_ax, rate_ax = axes
    for label, rs in ranks.items():
        rt = [x[H.T] - t0 for x in rs]
        depth_ax.step(rt, _series(rs, H.DEPTH), where="post", label=label)
        stall_ax.plot(rt, _series(rs, H.STALL, 100.0), label=label)
        rate_ax.plot(rt, _series(rs, H.BATCHES_PER_S), label=f"{label} took")
    stall_ax.legend(loc="upper right", fontsize="small")


def _plot_trainer(
    axes: tuple[Any, Any, Any], samples: list[dict[str, Any]], t: list[float]
) -> None:
    """The single trainer's depth, stall and rate."""
    depth_ax, stall_ax, rate_ax = axes
    depth_ax.step(t, _series(samples, H.DEPTH), where="post", color="tab:blue", label="depth")
    stall = _series(samples, H.STALL, 100.0)
    stall_ax.plot(t, stall, color="tab:red")
    stall_ax.fill_between(t, stall, color="tab:red", alpha=0.2)
    rate_ax.plot(t, _series(samples, H.BATCHES_PER_S), color="tab:green", label="trainer took")


def _label_axes(depth_ax: Any, stall_ax: Any, hwm: int) -> None:
    """The depth plot's cap, the labels and limits of the depth and stall plots."""
    if hwm:
        depth_ax.axhline(hwm, color="tab:gray", linestyle="--", label=f"hwm {hwm}")
    depth_ax.set_ylabel("frames in the queue")
    depth_ax.set_ylim(bottom=0)
    depth_ax.legend(loc="upper right")
    stall_ax.set_ylabel("trainer waiting (%)")
    stall_ax.set_ylim(0, 100)


def _plot_sizing(
    rate_ax: Any, samples: list[dict[str, Any]], t: list[float], sz: dict[str, Any]
) -> None:
    """Demand, supply and delivered on the rate plot (its limits once every line is
    drawn), MB/s on its twin axis."""
    for name, color, style in (
        ("demand", "tab:red", "--"),
        ("supply", "tab:blue", "-."),
        ("delivered", "tab:cyan", ":"),
    ):
        if any(v is not None for v in sz[name]):
            rate_ax.plot(t, _gaps(sz[name]), color=color, linestyle=style, label=name)
    rate_ax.legend(loc="upper left", fontsize="small", ncol=4)
    rate_ax.set_ylabel("batches/s")
    rate_ax.set_ylim(bottom=0)
    mb_ax = rate_ax.twinx()
    mb_ax.plot(t, _series(samples, H.MB_PER_S), color="tab:purple", linestyle=":", label="MB/s")
    mb_ax.set_ylabel("MB/s")
    mb_ax.set_ylim(bottom=0)


def _plot_producers(prod_ax: Any, t: list[float], sz: dict[str, Any]) -> None:
    """The producers alive, each join (+n) and leave (-n) marked."""
    counts = _gaps(sz["producers"])
    prod_ax.step(t, counts, where="post", color="tab:orange")
    for x, n, c in zip(t, counts, sz["change"], strict=True):
        if c:
            prod_ax.annotate(
                f"{c:+g}", (x, n), fontsize="x-small",
                xytext=(0, 4 if c > 0 else -10), textcoords="offset points", ha="center",
            )  # fmt: skip
    prod_ax.set_ylabel("producers")
    prod_ax.set_ylim(bottom=0)
    prod_ax.set_xlabel("seconds since the first sample")


def _reader_lines(
    ranks: dict[int, list[dict[str, Any]]], groups: dict[str, list[dict[str, Any]]]
) -> dict[str, list[dict[str, Any]]]:
    """The samples of each line the plots draw per reader: each rank, each group."""
    lines = {f"rank {r}": rs for r, rs in sorted(ranks.items())}
    lines |= {f"group {g or '(default)'}": gs for g, gs in groups.items()}
    return lines


def _figure(
    samples: list[dict[str, Any]],
    lines: dict[str, list[dict[str, Any]]],
    t0: float,
    t: list[float],
    hwm: int,
) -> Any:
    """The four plots, one above the other: depth, stall, rates (a line per rank or
    group of ``lines``, else the trainer's), the producers; ``t``: the samples' seconds
    since ``t0``."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 7.5), layout="constrained")
    FigureCanvasAgg(fig)
    depth_ax, stall_ax, rate_ax, prod_ax = fig.subplots(
        4, 1, sharex=True, height_ratios=[1, 1, 1.3, 0.8]
    )
    sz = sizing_series(samples)
    if lines:
        _plot_ranks((depth_ax, stall_ax, rate_ax), lines, t0)
    else:
        _plot_trainer((depth_ax, stall_ax, rate_ax), samples, t)
    _label_axes(depth_ax, stall_ax, hwm)
    _plot_sizing(rate_ax, samples, t, sz)
    _plot_producers(prod_ax, t, sz)
    _mark_changes([depth_ax, stall_ax, rate_ax], t, sz["change"])
    for ax in (depth_ax, stall_ax, rate_ax, prod_ax):
        ax.grid(alpha=0.3)
    return fig


def plot_report(
    samples: list[dict[str, Any]],
    out: str | Path,
    *,
    queue: str,
    hwm: int = 0,
    ranks: dict[int, list[dict[str, Any]]] | None = None,
    groups: dict[str, list[dict[str, Any]]] | None = None,
) -> Path:
    """Plot depth, stall % and throughput against seconds since the first sample.

    Args:
        samples: history samples, oldest first (at least one).
        out: the image's path; its suffix picks the format (png, svg, pdf).
        queue: the queue's name, for the title.
        hwm: the queue's cap, drawn as a line on the depth plot (0: not drawn).
        ranks: a data-parallel trainer's samples per rank: depth, stall and rate get a
            line per rank (``samples`` is one rank's, for the producers' side).
        groups: a run read by several groups: the samples of each group (its rank 0's),
            a line per group likewise.

    Returns:
        The path written.

    Raises:
        ConfigError: matplotlib is missing, there are no samples, or the file cannot be
            written.
    """
    _require_matplotlib()
    if not samples:
        raise ConfigError(
            f"queue {queue!r} has no history: the trainer writes one sample a second while it runs"
        )
    lines = _reader_lines(ranks or {}, groups or {})
    t0 = min(s[0][H.T] for s in [samples, *lines.values()] if s)
    t = [s[H.T] - t0 for s in samples]
    fig = _figure(samples, lines, t0, t, hwm)
    fig.suptitle(
        f"batchq queue {queue}: {len(samples)} samples over {t[-1]:.0f} s, "
        f"trainer waiting {100 * _mean_stall(samples):.0f}% on average"
    )
    path = Path(out)
    try:
        fig.savefig(path, dpi=100)
    except (OSError, ValueError) as e:
        raise ConfigError(f"--out {str(out)!r}: cannot write the report: {e}") from e
    return path


def _mean_stall(samples: list[dict[str, Any]]) -> float:
    """The stall fraction averaged over the samples (at least one)."""
    return sum(_series(samples, H.STALL)) / len(samples)


def summary_figures(client: Any, queue: str) -> dict[str, Any]:
    """What the report says beside the picture (one pipelined read): the run, the
    quarantined examples (the queue's counter and the run's) and the cache figures of
    every producer the pstats hash holds (:func:`cache_since_created`)."""
    (snap,) = read_snapshots(client, [queue], history=0, leases=False)
    return {
        "run": snap.meta.get(MetaField.RUN, ""),
        "quarantined": snap.stats.get(StatsField.QUARANTINED, 0),
        "quarantined_run": quarantined_in_run(snap),
        **cache_since_created(snap),
    }


def _summary_text(figures: dict[str, Any]) -> list[str]:
    """The lines of :func:`summary_figures`'s figures: none when there is nothing to say."""
    lines = cache_lines(figures)
    if figures["quarantined"]:
        lines.append(
            quarantine_line(figures["quarantined"], figures["quarantined_run"], figures["run"])
        )
    return lines


def summary_lines(client: Any, queue: str) -> list[str]:
    """The report's lines beside the picture: the quarantined examples (the run's and
    the queue's counter) and the cache figures of every producer the pstats hash holds;
    none of either when there is nothing to say (one pipelined read)."""
    return _summary_text(summary_figures(client, queue))


def _value(s: dict[str, Any], name: str) -> float | None:
    """A sample's number, None where it lacks it."""
    value = s.get(name)
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def report_json(
    samples: list[dict[str, Any]],
    path: Path,
    *,
    queue: str,
    hwm: int,
    world: int,
    groups: list[str],
    figures: dict[str, Any],
) -> dict[str, Any]:
    """The object ``report --json`` prints (its fields: this module's docstring).

    Args:
        samples: the plotted history samples, oldest first (at least one).
        path: the picture written.
        queue: the queue's name.
        hwm: the run's cap (0: unknown).
        world: the trainer's ranks.
        groups: the names of the groups reading the run (empty: one group).
        figures: :func:`summary_figures`'s.

    Returns:
        A JSON-ready dict.
    """
    t0 = samples[0][H.T]
    series: dict[str, list[float | None]] = {"t": [s[H.T] - t0 for s in samples]}
    for name in (H.DEPTH, H.STALL, H.BATCHES_PER_S, H.MB_PER_S):
        series[name] = [_value(s, name) for s in samples]
    sz = sizing_series(samples)
    for name in ("producers", "demand", "supply", "delivered"):
        series[name] = sz[name]
    return {
        "queue": queue,
        "out": str(path),
        "samples": len(samples),
        "span_s": samples[-1][H.T] - t0,
        "mean_stall": _mean_stall(samples),
        "hwm": hwm,
        "world_size": world,
        "groups": groups,
        **figures,
        "series": series,
    }


def run_report(args: argparse.Namespace) -> int:
    """Read the queue's history and write the picture; print what was written and the
    figures beside it (with ``--json``, as one JSON object: :func:`report_json`)."""
    _require_matplotlib()
    queue = check_name(args.queue, "queue")
    url = resolve_url(args.url)
    client = make_client(url, socket_timeout_s=10.0)
    try:
        where = describe_url(url)
        hwm_raw, world_raw = call(
            lambda: client.hmget(QueueKeys(queue).meta, [MetaField.HWM, MetaField.WORLD]),
            "reading the hwm",
        )
        registry = call(lambda: client.hgetall(QueueKeys(queue).groups), "reading the groups")
        world = int(world_raw or 1)
        groups = {
            as_text(name): call(
                lambda slot=int(slot): load_history(client, queue, 0, world, slot),  # type: ignore[misc]
                f"reading queue {queue} at {where}",
            )
            for name, slot in sorted(registry.items(), key=lambda item: int(item[1]))
        }
        ranks: dict[int, list[dict[str, Any]]] = {}
        for r in range(world):
            ranks[r] = call(
                lambda r=r: load_history(client, queue, r, world),  # type: ignore[misc]
                f"reading queue {queue} at {where}",
            )
        samples = ranks[0]
        figures = call(lambda: summary_figures(client, queue), f"reading queue {queue} at {where}")
    finally:
        client.close()
    hwm = int(hwm_raw) if hwm_raw else 0
    path = plot_report(
        samples,
        args.out,
        queue=queue,
        hwm=hwm,
        ranks=ranks if world > 1 and not groups else None,
        groups=groups or None,
    )
    if args.json:
        out = report_json(
            samples, path, queue=queue, hwm=hwm, world=world, groups=list(groups), figures=figures
        )
        print(json.dumps(out, indent=2))
        return 0
    print(f"wrote {path} ({len(samples)} samples of queue {queue!r})")
    for line in _summary_text(figures):
        print(line)
    return 0
