"""A PostgreSQL cluster in a project folder, for `make stack` (flows/services/stack.py): MLflow's and Prefect's store.

Debian's server binaries (``/usr/lib/postgresql/<version>/bin``, package ``postgresql``; scripts/ensure_postgres.sh
installs it), a cluster of the project's own (``initdb`` once into ``<state_dir>/postgres``), listening on a loopback
TCP port only (no unix socket), one role ``dapo`` with a generated password (``<state_dir>/postgres.password``, mode
0600; clients get it as ``PGPASSWORD``, never in a URI or a command line). PostgreSQL refuses to run as root: as root,
the cluster belongs to the ``postgres`` user the package creates, and its commands run through ``runuser``.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import secrets
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROLE = "dapo"
SERVICE_USER = "postgres"  # Debian's package creates it; the cluster runs as it when we are root


class PostgresError(RuntimeError):
    """PostgreSQL cannot be set up or started; the message says what and how to fix it."""


def bin_dir() -> Path:
    """The newest installed server's binaries (initdb, postgres, pg_ctl)."""
    found = shutil.which("initdb")
    if found:
        return Path(found).parent
    versions = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[-3]))
    if not versions:
        raise PostgresError(
            "PostgreSQL's server is not installed (no initdb on PATH or in /usr/lib/postgresql/*/bin): "
            "run scripts/ensure_postgres.sh (apt-get install postgresql), or put your server's bin folder on PATH"
        )
    return Path(versions[-1]).parent


def _as_owner(cmd: list[str]) -> list[str]:
    """``cmd`` run as the cluster's owner: ourselves, or the ``postgres`` user when we are root."""
    if os.geteuid() != 0:
        return cmd
    try:
        pwd.getpwnam(SERVICE_USER)
    except KeyError:
        raise PostgresError(
            f"running as root, and PostgreSQL refuses root: no '{SERVICE_USER}' user to run it as "
            "(Debian's postgresql package creates one): install the package, or start the stack as another user"
        ) from None
    return ["runuser", "-u", SERVICE_USER, "--", *cmd]


def _own(path: Path) -> None:
    if os.geteuid() == 0:
        shutil.chown(path, SERVICE_USER, SERVICE_USER)


@dataclass(frozen=True)
class Cluster:
    """The cluster in ``data_dir``, listening on ``host:port``."""

    data_dir: Path
    host: str
    port: int

    @property
    def password_file(self) -> Path:
        return self.data_dir.parent / "postgres.password"

    def password(self) -> str:
        try:
            return self.password_file.read_text(encoding="utf-8").strip()
        except OSError:
            raise PostgresError(
                f"{self.password_file} is missing while the cluster {self.data_dir} exists: remove {self.data_dir} "
                "to start over with a new cluster (its databases are lost), or restore the file"
            ) from None

    def initialised(self) -> bool:
        return (self.data_dir / "PG_VERSION").is_file()

    def init(self) -> None:
        """``initdb`` once: the role ``dapo`` with a new password, scram-sha-256 over TCP."""
        if self.initialised():
            return
        self.data_dir.mkdir(parents=True, exist_ok=True)
        _own(self.data_dir)
        self.password_file.write_text(secrets.token_urlsafe(24) + "\n", encoding="utf-8")
        self.password_file.chmod(0o600)
        pwfile = self.data_dir.parent / ".initdb-pw"
        try:
            pwfile.write_text(self.password() + "\n", encoding="utf-8")
            pwfile.chmod(0o600)
            _own(pwfile)
            cmd = [str(bin_dir() / "initdb"), "-D", str(self.data_dir.resolve()), "-U", ROLE, "-E", "UTF8",
                   "--locale=C", "--auth-host=scram-sha-256", "--auth-local=peer", f"--pwfile={pwfile.resolve()}"]  # fmt: skip
            done = subprocess.run(_as_owner(cmd), capture_output=True, text=True, check=False)
        finally:
            pwfile.unlink(missing_ok=True)
        if done.returncode != 0:
            raise PostgresError(
                f"initdb into {self.data_dir} failed (exit {done.returncode}):\n{done.stdout}{done.stderr}"
                f"Fix the cause above; remove {self.data_dir} before trying again"
            )

    def server_command(self) -> list[str]:
        """The server in the foreground (for flows.services.procs.launch): TCP on ``host`` only, no unix socket."""
        cmd = [str(bin_dir() / "postgres"), "-D", str(self.data_dir.resolve()), "-p", str(self.port),
               "-c", f"listen_addresses={self.host}", "-c", "unix_socket_directories="]  # fmt: skip
        return _as_owner(cmd)

    def client_env(self) -> dict[str, str]:
        """What a client (MLflow's psycopg2, Prefect's asyncpg) needs beside the URI: the password."""
        return {"PGPASSWORD": self.password()}

    def connect(self, database: str = "postgres") -> Any:
        """A psycopg2 connection as ``dapo`` (psycopg2-binary, a project dependency, imported here only)."""
        import psycopg2

        return psycopg2.connect(
            host=self.host, port=self.port, user=ROLE, password=self.password(), dbname=database, connect_timeout=3
        )

    def answers(self) -> bool:
        try:
            with contextlib.closing(self.connect()):
                return True
        except Exception:  # any failure to connect means "not yet"
            return False

    def ensure_database(self, name: str) -> None:
        """Create database ``name`` (owned by ``dapo``) unless it exists."""
        with contextlib.closing(self.connect()) as conn:
            conn.autocommit = True  # CREATE DATABASE cannot run in a transaction
            with conn.cursor() as cur:
                cur.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,))
                if cur.fetchone() is None:
                    cur.execute(f'CREATE DATABASE "{name}"')

    def url(self, database: str, driver: str = "postgresql") -> str:
        """A SQLAlchemy URL without the password (``PGPASSWORD`` carries it)."""
        return f"{driver}://{ROLE}@{self.host}:{self.port}/{database}"

    def stop_fast(self, timeout_s: float = 30.0) -> bool:
        """``pg_ctl stop -m fast``: clients disconnected, a clean shutdown. False if it did not stop."""
        cmd = [str(bin_dir() / "pg_ctl"), "stop", "-D", str(self.data_dir.resolve()), "-m", "fast", "-w",
               "-t", str(int(timeout_s))]  # fmt: skip
        done = subprocess.run(_as_owner(cmd), capture_output=True, text=True, check=False)
        return done.returncode == 0
