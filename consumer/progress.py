"""An optional per-epoch progress bar: batches, rate and stall %, on stderr (rich)."""

from __future__ import annotations

from typing import Any

from batchq.errors import ConfigError

__all__ = ["EpochProgress"]


class EpochProgress:
    """One epoch's bar.

    Args:
        epoch: the epoch's number (for the label).
        total: batches in the epoch, if known.

    Raises:
        ConfigError: rich is not installed.
    """

    def __init__(self, epoch: int, total: int | None) -> None:
        try:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
        except ImportError as e:  # pragma: no cover - rich is a dependency
            raise ConfigError("progress=True needs the 'rich' package") from e
        self._progress = Progress(
            TextColumn(f"epoch {epoch}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[rate]:>7.1f} batches/s  stall {task.fields[stall]:>5.1f}%"),
            transient=False,
        )
        self._task = self._progress.add_task("epoch", total=total, rate=0.0, stall=0.0)
        self._progress.start()

    def update(self, figures: dict[str, Any]) -> None:
        """Advance by one batch and show the current rate and stall fraction."""
        self._progress.update(
            self._task,
            advance=1,
            rate=figures["batches_per_s"],
            stall=100 * figures["stall_fraction_epoch"],
        )

    def close(self) -> None:
        """Stop drawing (the last state stays on screen)."""
        self._progress.stop()
