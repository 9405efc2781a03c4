"""The ablation's journal: every finished (regime, rung, seed) record, so an interrupted ablation resumes.

A full ``dapo ablation`` runs for hours (7 rungs x 3 seeds x 2 regimes on 2 CPU cores); a kill, a reboot or the end
of a working session must not throw the finished runs away. Each finished run appends one JSON line (written and
fsynced before the next run starts) under a fingerprint of everything that determines its result: the run's
resolved config, the base model's weights and the evaluation data. ``--resume`` reuses a record only when its
fingerprint matches, so a changed recipe, override, base model or data file reruns exactly the runs it affects.

Pure file handling (no Prefect, no MLflow)::

    journal = AblationJournal.open("outputs/ablation.journal.jsonl", resume=True)
    key = fingerprint({"config": ..., "base": file_digest(...)})
    record = journal.get(key) or journal.put(key, run_it())
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

JOURNAL_VERSION = 1


def fingerprint(parts: Mapping[str, Any]) -> str:
    """sha256 of the canonical JSON of ``parts`` (keys sorted; values must be JSON-serialisable)."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode("utf-8")).hexdigest()


def file_digest(path: str | Path) -> str:
    """sha256 of a file's bytes, or of a directory's files (names and bytes, sorted by name); "missing" if absent."""
    p = Path(path)
    if p.is_file():
        files = [p]
    elif p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file())
    else:
        return "missing"
    h = hashlib.sha256()
    for f in files:
        h.update(str(f.relative_to(p) if p.is_dir() else f.name).encode("utf-8"))
        with f.open("rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


class AblationJournal:
    """Append-only JSON lines: ``{"key", "record"}`` per finished run, plus ``{"parent_run_id"}`` lines."""

    def __init__(self, path: Path, records: dict[str, dict[str, Any]], parent_run_id: str | None) -> None:
        self.path = path
        self._records = records
        self.parent_run_id = parent_run_id
        self.reused = 0

    @classmethod
    def open(cls, path: str | Path, *, resume: bool) -> AblationJournal:
        """Read the journal at ``path`` when ``resume``; otherwise set an existing one aside (renamed with its
        modification time, never deleted) and start an empty one."""
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        if not resume:
            if p.exists() and p.stat().st_size > 0:
                stamp = datetime.fromtimestamp(p.stat().st_mtime).strftime("%Y%m%dT%H%M%S")
                aside = p.with_name(f"{p.stem}.{stamp}{p.suffix}")
                p.replace(aside)
                logger.info("ablation journal: the previous one set aside as %s (--resume reuses a journal)", aside)
            return cls(p, {}, None)
        records: dict[str, dict[str, Any]] = {}
        parent: str | None = None
        if p.exists():
            text = p.read_text(encoding="utf-8")
            if text and not text.endswith("\n"):
                with p.open("a", encoding="utf-8") as fh:  # end a line cut by a kill, so appends start clean
                    fh.write("\n")
            for lineno, line in enumerate(text.splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    item = json.loads(line)
                except json.JSONDecodeError:
                    # a line cut by a kill mid-write: that run is simply run again
                    logger.warning("ablation journal %s:%d is not JSON (cut by a kill?): ignored", p, lineno)
                    continue
                if not isinstance(item, dict) or item.get("version") != JOURNAL_VERSION:
                    logger.warning("ablation journal %s:%d has another format: ignored", p, lineno)
                    continue
                if "parent_run_id" in item:
                    parent = str(item["parent_run_id"])
                elif isinstance(item.get("key"), str) and isinstance(item.get("record"), dict):
                    records[item["key"]] = item["record"]
        return cls(p, records, parent)

    def __len__(self) -> int:
        return len(self._records)

    def get(self, key: str, *, count: bool = True) -> dict[str, Any] | None:
        """The journaled record of ``key`` (counted in ``reused`` unless ``count`` is false), or None."""
        record = self._records.get(key)
        if record is not None and count:
            self.reused += 1
        return record

    def put(self, key: str, record: dict[str, Any]) -> dict[str, Any]:
        """Journal a finished run (one line, flushed and fsynced) and return the record."""
        self._records[key] = record
        self._append({"version": JOURNAL_VERSION, "key": key, "record": record})
        return record

    def set_parent(self, run_id: str) -> None:
        """Remember the parent MLflow run, so a resumed ablation nests its new children under the same parent."""
        if run_id != self.parent_run_id:
            self.parent_run_id = run_id
            self._append({"version": JOURNAL_VERSION, "parent_run_id": run_id})

    def _append(self, item: dict[str, Any]) -> None:
        with self.path.open("a", encoding="utf-8") as fh:
            fh.write(json.dumps(item, sort_keys=True) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
