"""What a long command shows on screen, and what goes to its log file instead.

Prefect logs every task and flow run's end ("Finished in state Completed()") and MLflow its system-metrics monitor
starting and stopping, at INFO: hundreds of lines per pipeline. ``route_logs`` keeps the screen for warnings and
errors (and for what the command prints itself: stage lines, progress bars, the summary) and sends every INFO
record to the run's log file:

    routing = route_logs(Path("outputs/tiny-dapo/pipeline.log"))   # after prefect and mlflow are imported
    ...                                                              # run the flow
    routing.restore()                                                # optional: the process may just exit

How it works with Prefect 3.9 and MLflow 3.17 (measured): Prefect's ``prefect``, ``prefect.flow_runs`` and
``prefect.task_runs`` loggers propagate to the root logger (Prefect drops its own root console handler when the
application configured one, as ``dapo``'s ``logging.basicConfig`` does), so replacing the root handlers catches
them; their API handler (the Prefect UI's run logs) stays. MLflow gives its loggers (``mlflow``, ``alembic``,
``huey``, ``sqlalchemy.engine``) their own stderr handler and no propagation when ``mlflow`` is imported: those
are pointed at the root logger too. Python warnings are captured as records of ``py.warnings`` (so on screen).
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

FILE_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
SCREEN_FORMAT = "%(levelname)s %(name)s: %(message)s"
# loggers MLflow gives a handler of their own (mlflow.utils.logging_utils._configure_mlflow_loggers)
OWN_HANDLER_LOGGERS = ("mlflow", "alembic", "huey", "sqlalchemy.engine")


class _ScreenHandler(logging.Handler):
    """Writes to whatever ``sys.stderr`` is at the time: a live progress display redirects it above its bars."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            sys.stderr.write(self.format(record) + "\n")
            sys.stderr.flush()
        except Exception:
            self.handleError(record)


class LogRouting:
    """The installed routing; ``restore()`` puts the previous handlers back (tests; a CLI may simply exit)."""

    def __init__(self, log_file: Path, *, verbose: bool = False) -> None:
        self.log_file = log_file
        self.verbose = verbose
        self.file_handler: logging.FileHandler | None = None
        self.screen_handler: logging.Handler | None = None
        self._saved_root: tuple[list[logging.Handler], int] | None = None
        self._saved: dict[str, tuple[list[logging.Handler], bool]] = {}

    def install(self) -> LogRouting:
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        self.file_handler = logging.FileHandler(self.log_file, encoding="utf-8")
        self.file_handler.setFormatter(logging.Formatter(FILE_FORMAT))
        self.file_handler.setLevel(logging.DEBUG if self.verbose else logging.INFO)
        self.screen_handler = _ScreenHandler(level=logging.INFO if self.verbose else logging.WARNING)
        self.screen_handler.setFormatter(logging.Formatter(SCREEN_FORMAT))

        root = logging.getLogger()
        self._saved_root = (list(root.handlers), root.level)
        root.handlers = [self.file_handler, self.screen_handler]
        root.setLevel(logging.DEBUG if self.verbose else logging.INFO)
        for name in OWN_HANDLER_LOGGERS:
            lg = logging.getLogger(name)
            self._saved[name] = (list(lg.handlers), lg.propagate)
            lg.handlers, lg.propagate = [], True
        logging.captureWarnings(True)
        return self

    def restore(self) -> None:
        """Undo ``install`` (idempotent) and close the log file."""
        if self._saved_root is None:
            return
        logging.captureWarnings(False)
        root = logging.getLogger()
        root.handlers, level = self._saved_root
        root.setLevel(level)
        for name, (handlers, propagate) in self._saved.items():
            lg = logging.getLogger(name)
            lg.handlers, lg.propagate = handlers, propagate
        self._saved_root, self._saved = None, {}
        if self.file_handler is not None:
            self.file_handler.close()


def route_logs(log_file: Path, *, verbose: bool = False) -> LogRouting:
    """Warnings and errors on screen, everything from INFO (DEBUG with ``verbose``) into ``log_file`` (appended).

    Call it after ``prefect`` and ``mlflow`` are imported: importing ``mlflow`` resets its loggers' handlers.
    ``verbose`` also shows INFO records on screen (the old wall of text)."""
    return LogRouting(log_file, verbose=verbose).install()
