"""One Prefect test server for the whole pytest session, entered module by module.

``prefect_test_harness`` starts a server subprocess (~10-20 s on 2 busy cores) every time it is entered; a dozen
modules entering it cost ~2.5 minutes of the suite. Here the server (on a temporary SQLite database) starts once,
when the first module asks for it (the ``prefect_api`` fixture, tests/conftest.py), and each module enters the same
settings the harness would (API URL, database, the default-server registration and the process-global settings),
leaving them when it ends, so modules that do not ask (the UI and serve tests, commands that start their own
temporary server) never see it. Mirrors prefect 3.9's ``prefect_test_harness``; revisit on a Prefect upgrade.
"""

from __future__ import annotations

import inspect
import socket
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from tempfile import mkdtemp

import prefect.context
import prefect.settings
from prefect.events.worker import EventsWorker
from prefect.logging.handlers import APILogWorker
from prefect.server.api.server import SubprocessASGIServer
from prefect.server.database.dependencies import temporary_database_interface
from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_DATABASE_CONNECTION_URL, temporary_settings
from prefect.utilities.asyncutils import run_coro_as_sync


def start_server(timeout_s: int = 120) -> tuple[SubprocessASGIServer, str]:
    """A Prefect API server subprocess on a fresh temporary database; (server, database URL)."""
    db_url = "sqlite+aiosqlite:///" + str(Path(mkdtemp(prefix="dapo-prefect-")) / "prefect-test.db")
    with temporary_settings(updates={PREFECT_SERVER_DATABASE_CONNECTION_URL: db_url}):
        server = SubprocessASGIServer(port=_free_port())
        server.start(timeout=timeout_s)  # the subprocess takes the current settings (the database) with it
    return server, db_url


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _drain() -> None:
    try:
        result = APILogWorker.instance().drain()
        if inspect.isawaitable(result):
            await result
    except RuntimeError:  # the log worker never started
        pass
    result = EventsWorker.drain_all()
    if inspect.isawaitable(result):
        await result


@contextmanager
def entered(server: SubprocessASGIServer, db_url: str) -> Iterator[str]:
    """Flows run in this block report to ``server``; yields its API URL."""
    prior = SubprocessASGIServer._instances.get(None)
    SubprocessASGIServer._instances[None] = server  # code asking for "the" ephemeral server finds this one
    try:
        with ExitStack() as stack:
            stack.enter_context(temporary_database_interface())
            updates = {PREFECT_SERVER_DATABASE_CONNECTION_URL: db_url, PREFECT_API_URL: server.api_url}
            stack.enter_context(temporary_settings(updates=updates))
            stack.enter_context(
                prefect.context._temporary_global_settings_context(prefect.context.get_settings_context())
            )
            yield server.api_url
            run_coro_as_sync(_drain())  # nothing of this module's runs reaches the next one
    finally:
        if prior is not None:
            SubprocessASGIServer._instances[None] = prior
        else:
            SubprocessASGIServer._instances.pop(None, None)
