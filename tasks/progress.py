"""Console progress for the long stages: a live bar on a terminal, a few plain lines elsewhere, nothing otherwise.

Tasks report progress without knowing where it goes; a command (``dapo pipeline``) attaches a ``Reporter`` for its
length. With none attached (library use, tests, runs started by ``dapo serve``) every call here is a no-op, so the
flows run the same everywhere.

    from tasks import progress
    with progress.bar("warm start", total=1200, unit="step") as bar:
        bar.update(120, {"loss": 0.53, "token acc": 0.81})
    progress.note({"val avg@8": 0.302})       # a field of the innermost open bar (e.g. the latest validation score)
    progress.echo("curate  388 train / 12 val problems  1.2s")

    with progress.attached(progress.Reporter()):   # in a CLI command: bars and lines go to stdout
        ...

On a terminal the bars are rich progress bars, removed when done (the stage's summary line replaces them); when
stdout is not a terminal (CI, a pipe, a log file) a bar prints one plain line per fifth of its total, or after a
minute without one, and a last line when it ends: no carriage returns.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, ProgressColumn, SpinnerColumn, Task, TextColumn
from rich.text import Text

Fields = Mapping[str, float | int | str]

PLAIN_STEPS = 5  # a plain line each time another fifth of the total is done ...
PLAIN_EVERY_S = 60.0  # ... or when a minute passed without one


def fmt_duration(seconds: float) -> str:
    """0.8s, 42s, 3m12s, 1h02m."""
    if seconds < 10:
        return f"{seconds:.1f}s"
    if seconds < 60:
        return f"{seconds:.0f}s"
    minutes, secs = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


def fmt_fields(fields: Fields) -> str:
    """``loss 0.532  acc 0.812``: floats with 3 decimals, the rest as given."""
    return "  ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in fields.items())


class Bar:
    """A progress bar that goes nowhere (no reporter attached); the base of the real ones."""

    def __init__(self, desc: str, total: int, unit: str) -> None:
        self.desc, self.total, self.unit = desc, max(int(total), 0), unit
        self.completed = 0
        self.fields: dict[str, float | int | str] = {}
        self.started = time.monotonic()

    def update(self, completed: int, fields: Fields | None = None, *, first: bool = False) -> None:
        """Set the number done (absolute, not an increment) and merge ``fields`` into the postfix
        (``first``: put them before the fields already there)."""
        self.completed = min(int(completed), self.total) if self.total else int(completed)
        new = dict(fields or {})
        self.fields = {**new, **self.fields, **new} if first else {**self.fields, **new}
        self._show()

    def note(self, fields: Fields) -> None:
        """Merge ``fields`` into the postfix without moving the bar."""
        self.fields.update(fields)
        self._show()

    def close(self) -> None:
        """The bar is done (or abandoned by an error)."""

    def _show(self) -> None:
        pass


class _PlainBar(Bar):
    """Occasional whole lines: each fifth of the total (or a minute without a line), then the last state."""

    def __init__(self, reporter: Reporter, desc: str, total: int, unit: str) -> None:
        super().__init__(desc, total, unit)
        self._reporter = reporter
        self._printed_step = 0
        self._printed_at = self.started
        self._printed_completed = -1

    def _line(self) -> str:
        elapsed = time.monotonic() - self.started
        pct = f" ({100 * self.completed / self.total:.0f}%)" if self.total else ""
        timing = fmt_duration(elapsed)
        if self.total and 0 < self.completed < self.total:
            timing += f", ~{fmt_duration(elapsed * (self.total - self.completed) / self.completed)} left"
        parts = [
            f"  {self.desc}: {self.completed}/{self.total} {self.unit}s{pct}",
            fmt_fields(self.fields),
            f"[{timing}]",
        ]
        return "  ".join(p for p in parts if p)

    def _fifth(self) -> int:
        return int(PLAIN_STEPS * self.completed / self.total + 1e-9) if self.total else 0

    def _show(self) -> None:
        now = time.monotonic()
        due = self._fifth() > self._printed_step or now - self._printed_at >= PLAIN_EVERY_S
        if due and self.completed != self._printed_completed and self.completed < self.total:
            self._emit(now)

    def _emit(self, now: float) -> None:
        self._reporter.echo(self._line())
        self._printed_step, self._printed_at, self._printed_completed = self._fifth(), now, self.completed

    def close(self) -> None:
        if self.completed != self._printed_completed:  # the final state, once
            self._emit(time.monotonic())


class _BarColumn(BarColumn):
    def render(self, task: Task) -> Any:
        return super().render(task) if task.total is not None else Text("")  # a spinner task: no pulsing bar


class _CountColumn(ProgressColumn):
    def render(self, task: Task) -> Text:
        if task.total is None:
            return Text("")
        return Text(f"{int(task.completed)}/{int(task.total)} {task.fields.get('unit', '')}s")


class _TimeColumn(ProgressColumn):
    def render(self, task: Task) -> Text:
        elapsed = task.elapsed or 0.0
        text = fmt_duration(elapsed)
        if task.total and 0 < task.completed < task.total:
            text += f", ~{fmt_duration(elapsed * (task.total - task.completed) / task.completed)} left"
        return Text(text)


class _LiveBar(Bar):
    """A task of the reporter's rich ``Progress``; removed when closed (the stage line replaces it)."""

    def __init__(self, progress: Progress, desc: str, total: int, unit: str) -> None:
        super().__init__(desc, total, unit)
        self._progress = progress
        self._task = progress.add_task(desc, total=self.total or None, unit=unit, postfix="")

    def _show(self) -> None:
        self._progress.update(self._task, completed=self.completed, postfix=fmt_fields(self.fields))

    def close(self) -> None:
        self._progress.remove_task(self._task)
        self._progress.refresh()  # gone now, not at the next tick (a line printed next would repeat it)


class Reporter:
    """Where a command's progress goes: ``console`` (default: stdout), live bars only when it is a terminal.

    ``live=False`` forces the plain lines even on a terminal; ``live=True`` forces the bars.
    """

    def __init__(self, console: Console | None = None, *, live: bool | None = None) -> None:
        self.console = console or Console(soft_wrap=True, highlight=False)
        self.live = self.console.is_terminal if live is None else live
        self._progress: Progress | None = None
        self._lock = threading.Lock()
        self._waiting: Any = None  # a spinner task shown until the next bar or activity opens

    def _live_progress(self) -> Progress:
        with self._lock:
            if self._progress is None:
                self._progress = Progress(
                    SpinnerColumn(),
                    TextColumn("{task.description}"),
                    _BarColumn(bar_width=30),
                    _CountColumn(),
                    _TimeColumn(),
                    TextColumn("{task.fields[postfix]}"),
                    console=self.console,
                    refresh_per_second=4,
                    redirect_stdout=True,
                    redirect_stderr=True,  # log records written to stderr print above the bars
                )
                self._progress.start()
            return self._progress

    def echo(self, line: str) -> None:
        """One line on the console (above the live bars, if any)."""
        self.console.print(line, markup=False, highlight=False, soft_wrap=True)

    def waiting(self, desc: str) -> None:
        """A spinner with ``desc`` until the next bar or activity opens (terminal only)."""
        if self.live:
            self._end_waiting()
            self._waiting = self._live_progress().add_task(desc, total=None, unit="", postfix="")

    def _end_waiting(self) -> None:
        if self._waiting is not None and self._progress is not None:
            self._progress.remove_task(self._waiting)
            self._progress.refresh()
        self._waiting = None

    def open_bar(self, desc: str, total: int, unit: str) -> Bar:
        if self.live:
            self._end_waiting()
            return _LiveBar(self._live_progress(), desc, total, unit)
        return _PlainBar(self, desc, total, unit)

    @contextmanager
    def activity(self, desc: str) -> Iterator[None]:
        """A spinner with ``desc`` while the block runs (terminal only; nothing in plain mode)."""
        if not self.live:
            yield
            return
        self._end_waiting()
        progress = self._live_progress()
        task = progress.add_task(desc, total=None, unit="", postfix="")
        try:
            yield
        finally:
            progress.remove_task(task)
            progress.refresh()

    def close(self) -> None:
        """Stop the live display (idempotent)."""
        with self._lock:
            if self._progress is not None:
                self._progress.stop()
                self._progress, self._waiting = None, None


_state: dict[str, Any] = {"reporter": None, "bars": []}


def current() -> Reporter | None:
    """The attached reporter, if a command attached one."""
    return _state["reporter"]


@contextmanager
def attached(reporter: Reporter) -> Iterator[Reporter]:
    """Send progress to ``reporter`` for the length of the block (then stop its live display)."""
    previous = _state["reporter"]
    _state["reporter"] = reporter
    try:
        yield reporter
    finally:
        _state["reporter"] = previous
        reporter.close()


@contextmanager
def bar(desc: str, total: int, unit: str = "step") -> Iterator[Bar]:
    """A progress bar for the block: live, plain or a no-op, per the attached reporter."""
    reporter = current()
    b = reporter.open_bar(desc, total, unit) if reporter is not None else Bar(desc, total, unit)
    _state["bars"].append(b)
    try:
        yield b
    finally:
        _state["bars"].remove(b)
        b.close()


def note(fields: Fields) -> None:
    """Merge ``fields`` into the innermost open bar's postfix (no-op without one)."""
    if _state["bars"]:
        _state["bars"][-1].note(fields)


def echo(line: str) -> None:
    """A line on the attached reporter's console (no-op without one)."""
    reporter = current()
    if reporter is not None:
        reporter.echo(line)


@contextmanager
def activity(desc: str) -> Iterator[None]:
    """A spinner while the block runs, on a terminal with a reporter attached."""
    reporter = current()
    if reporter is None:
        yield
        return
    with reporter.activity(desc):
        yield
