"""The ablation's journal: every finished (regime, rung, seed) record, so an interrupted ablation resumes.

A full ``dapo ablation`` runs for hours (7 rungs x 3 seeds x 2 regimes on 2 CPU cores); a kill, a reboot or the end
of a working session must not throw the finished runs away. Each finished run appends one JSON line (written and
fsynced before the next run starts) under a fingerprint of everything that determines its result: the run's
resolved config, the base model's weights and the evaluation data. ``--resume`` reuses a record only when its
fingerprint matches, so a changed recipe, override, base model or data file reruns exactly the runs it affects.

The code is part of a run's identity too (``code_digest``): a run trained by other code is another run, so a
``--resume`` after a change to the algorithm trains again instead of reusing what the old code trained. Each run is
journaled under two fingerprints: ``key`` (the parts and the code digest: what is reused) and ``config_key`` (the
parts alone: which journaled run a code change replaced, so the flow can say how many it trains again). Lines
written before the code was in the key carry no ``config_key``; their key was the parts alone, which is what
``config_key`` is now: they never match a new key (so they are trained again), and they are counted as trained by
other code.

Pure file handling (no Prefect, no MLflow)::

    journal = AblationJournal.open("outputs/ablation.journal.jsonl", resume=True)
    key = fingerprint({"config": ..., "base": file_digest(...)})
    record = journal.get(key) or journal.put(key, run_it())
"""

from __future__ import annotations

import functools
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

# What ``code_digest`` hashes: every ``.py`` file of the three installed packages (pyproject's packages.find), i.e.
# the code that builds the config, curates, warm-starts, rolls out, scores, trains and evaluates a run. Left out:
# docs and markdown (no effect on a result), ``tests/`` (the ablation does not run them), ``recipes/*.yaml`` and
# ``params.yaml`` (their content reaches the key as the resolved config), ``benchmarks/`` and ``scripts/`` (not on
# the ablation's path), ``__pycache__`` (derived from the sources) and the installed dependencies (pinned by
# ``constraints.txt``, outside this tree). The packages hold no other file (package-data is ``*.yaml``, none today);
# a non-``.py`` file added to them later would need adding here. Also left out: ``flows/services/`` (the local
# services started beside runs: the team stack, the UI servers, the headless browser, the process reaper), which the
# code that trains and evaluates does not import (only ``flows/cli/`` does, to start them and to reap subprocesses
# at exit; tests/test_ablation_journal.py checks it), so a fix to the stack does not make ``--resume`` train every
# journaled run again.
CODE_PACKAGES = ("dapo_core", "tasks", "flows")
CODE_EXCLUDED = ("flows/services",)
CODE_SUFFIX = ".py"
PROJECT_ROOT = Path(__file__).resolve().parents[2]


def code_files(root: str | Path | None = None) -> list[Path]:
    """The files ``code_digest`` hashes under ``root`` (default: this checkout): the ``.py`` files of
    ``CODE_PACKAGES``, ``__pycache__`` and ``CODE_EXCLUDED`` left out, sorted by their path relative to ``root``."""
    base = Path(root) if root is not None else PROJECT_ROOT
    found = [
        f
        for package in CODE_PACKAGES
        for f in (base / package).rglob(f"*{CODE_SUFFIX}")
        if f.is_file()
        and "__pycache__" not in f.relative_to(base).parts
        and not any(f.relative_to(base).as_posix().startswith(f"{ex}/") for ex in CODE_EXCLUDED)
    ]
    return sorted(found, key=lambda f: f.relative_to(base).as_posix())


@functools.lru_cache(maxsize=8)
def code_digest(root: str | Path | None = None) -> str:
    """sha256 over the relative path and the bytes of each of ``code_files(root)``: the code that trains and
    evaluates a run, part of its journal key. Cached per process and root (the code a process runs does not change
    under it; ``code_digest.cache_clear()`` to hash again)."""
    base = Path(root) if root is not None else PROJECT_ROOT
    h = hashlib.sha256()
    for f in code_files(base):
        rel = f.relative_to(base).as_posix().encode("utf-8")
        data = f.read_bytes()
        h.update(len(rel).to_bytes(8, "big") + rel + len(data).to_bytes(8, "big") + data)  # unambiguous framing
    return h.hexdigest()


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


def is_run_record(record: Mapping[str, Any]) -> bool:
    """A trained run's record (a training run or a control), not an evaluation journaled under a run."""
    return "run_id" in record and "scored_run_id" not in record


class AblationJournal:
    """Append-only JSON lines: ``{"key", "config_key", "record"}`` per finished run, plus ``{"parent_run_id"}``
    lines. ``reused``: runs reused in this process; ``retrained_for_code``: journaled runs trained again because
    other code trained them."""

    def __init__(
        self,
        path: Path,
        records: dict[str, dict[str, Any]],
        parent_run_id: str | None,
        config_keys: dict[str, str] | None = None,
    ) -> None:
        self.path = path
        self._records = records
        self._config_keys = dict(config_keys or {})  # key -> config_key (a line without one: its key)
        self._by_config = {self._config_keys.get(k, k): k for k in records}  # the latest run of each config_key
        self.parent_run_id = parent_run_id
        self.reused = 0
        self.retrained_for_code = 0

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
        config_keys: dict[str, str] = {}
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
                    if isinstance(item.get("config_key"), str):
                        config_keys[item["key"]] = item["config_key"]
        return cls(p, records, parent, config_keys)

    def __len__(self) -> int:
        return len(self._records)

    def get(self, key: str, *, count: bool = True) -> dict[str, Any] | None:
        """The journaled record of ``key`` (counted in ``reused`` unless ``count`` is false), or None."""
        record = self._records.get(key)
        if record is not None and count:
            self.reused += 1
        return record

    def put(self, key: str, record: dict[str, Any], *, config_key: str | None = None) -> dict[str, Any]:
        """Journal a finished run (one line, flushed and fsynced) and return the record. ``config_key``: the run's
        fingerprint without the code (kept from an earlier put of ``key`` when not given)."""
        config_key = config_key or self._config_keys.get(key)
        self._records[key] = record
        item: dict[str, Any] = {"version": JOURNAL_VERSION, "key": key, "record": record}
        if config_key is not None:
            self._config_keys[key] = config_key
            self._by_config[config_key] = key
            item["config_key"] = config_key
        else:
            self._by_config[key] = key
        self._append(item)
        return record

    def other_code(self, config_key: str, code: str) -> dict[str, Any] | None:
        """The journaled run of ``config_key`` (same config, base model and data) when other code trained it: its
        ``code_digest`` differs from ``code`` or it has none (a line from before code digests). None when there is
        no such run or ``code`` trained it."""
        key = self._by_config.get(config_key)
        record = self._records.get(key) if key is not None else None
        if record is None or not is_run_record(record) or record.get("code_digest") == code:
            return None
        return record

    def runs_by_other_code(self, code: str) -> dict[str, int]:
        """How many journaled runs each other code digest trained (``"none"``: lines from before code digests), of
        the latest run of each config (one trained again by ``code`` since no longer counts)."""
        counts: dict[str, int] = {}
        for key in set(self._by_config.values()):
            record = self._records[key]
            if is_run_record(record) and record.get("code_digest") != code:
                other = str(record.get("code_digest") or "none")
                counts[other] = counts.get(other, 0) + 1
        return counts

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
