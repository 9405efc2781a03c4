"""Whether a source file stayed the same while a curation used it.

A curation reads each source, works on the rows for a while, then writes its outputs and records the sources' md5s.
A file rewritten meanwhile (a `dapo data generate --force`, a download, an editor) would give rows that mix two
versions, or a data card whose md5 names bytes that were never curated. So each local source is stamped (size,
modification time, inode) before it is read; ``load_source`` compares the stamp after reading, and the curation
compares it again just before writing (``check_unchanged``), with the md5 of the bytes too (file times tick in
milliseconds: a same-size rewrite within one tick keeps the stamp). A change is ``SourceChangedError``: nothing is
written, the previous curated files stay as they were.

    stamp = file_stamp("data/synthetic/problems.jsonl")   # FileStamp(size=..., mtime_ns=..., inode=...)
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol


class SourceChangedError(RuntimeError):
    """A source file changed while a curation was using it; the message names the file and what to do."""


@dataclass(frozen=True)
class FileStamp:
    """What changes when a file is rewritten in place (size, mtime) or replaced by a rename (inode)."""

    size: int
    mtime_ns: int
    inode: int

    def describe(self) -> str:
        return f"{self.size} bytes, modified {self.mtime_ns / 1e9:.3f}, inode {self.inode}"


def file_stamp(path: str | os.PathLike[str]) -> FileStamp:
    st = os.stat(path)
    return FileStamp(size=st.st_size, mtime_ns=st.st_mtime_ns, inode=st.st_ino)


def file_md5(path: str | Path, chunk: int = 1 << 20) -> str:
    """md5 of the file bytes (DVC's file hash, so it can be checked against DVC's records)."""
    h = hashlib.md5()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


class _Stamped(Protocol):
    source: str
    digest: str
    stamp: FileStamp | None


def _message(path: str, before: FileStamp, after: FileStamp | None, when: str) -> str:
    now = after.describe() if after is not None else "gone"
    return (
        f"{path}: the source file changed {when} (read as {before.describe()}; now {now}), so the curated rows "
        "could mix two versions of it. Nothing was written: the previous curated files are unchanged. Run the "
        "curation again once nothing is writing that file (e.g. after `dapo data generate` has finished)"
    )


def check_stamp(path: str, before: FileStamp, when: str) -> None:
    """Raise ``SourceChangedError`` when ``path`` no longer has the stamp ``before``."""
    try:
        after: FileStamp | None = file_stamp(path)
    except FileNotFoundError:
        after = None
    if after != before:
        raise SourceChangedError(_message(path, before, after, when))


def check_unchanged(sources: Iterable[_Stamped]) -> None:
    """Every stamped source still as it was read: same stamp and same md5 as its ``digest`` (sources without a
    stamp, e.g. Hugging Face ids, are skipped)."""
    when = "after it was read, while the curation was running"
    for rows in sources:
        if rows.stamp is None:
            continue
        check_stamp(rows.source, rows.stamp, when)
        if file_md5(rows.source) != rows.digest:
            raise SourceChangedError(_message(rows.source, rows.stamp, file_stamp(rows.source), when))
