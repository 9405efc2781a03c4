"""Source loaders: every shape of problem file becomes one column-wise ``SourceRows``, nothing validated yet.

Formats (a registry; ``SourceSpec.format`` picks one, or it is detected from the path):

- ``verl``: the verl / DAPO RL parquet (``data_source``, ``prompt`` chat list, ``ability``, ``reward_model``
  {``ground_truth``, ``style``}, ``extra_info``) -- DAPO-Math-17k and AIME-2024 are published this way;
- ``parquet`` / ``jsonl`` / ``csv``: one problem per row with ``problem`` + ``answer`` columns (names
  configurable), e.g. the synthetic task's ``data/synthetic/problems.jsonl``;
- ``hf``: a Hugging Face dataset id (``hf:BytedTsinghua-SIA/DAPO-Math-17k``), read with the ``datasets``
  package when it is installed, then handled as ``verl`` or ``parquet`` by its columns.

Columns are stored as codes into their distinct values (``Column``): the published DAPO-Math-17k file repeats
~17.9k problems ~100x, so curation works on the distinct values and a 1.8M-row file costs little memory.

A file-level problem (missing file or column, wrong column type) raises ``SchemaError`` naming the file, the
column and what was expected; a row-level problem is left for validation (``dapo_core.data.curate``), so one bad
row never stops a curation.

    rows = load_source(SourceSpec(path="data/aime-2024.parquet"))   # your copy of verl's AIME-2024 file
    len(rows), rows.loader, rows.templated      # 960, "verl", True
"""

from __future__ import annotations

import csv
import json
import logging
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from dapo_core.config.curation import DEFAULT_DATA_SOURCE, SourceSpec
from dapo_core.data.arrow_columns import BATCH_ROWS, last_user_message, require_columns, struct_field
from dapo_core.data.freshness import FileStamp, check_stamp, file_md5, file_stamp
from dapo_core.data.schema import Column, ColumnBuilder, SchemaError, column_from_arrow

logger = logging.getLogger(__name__)

HF_PREFIX = "hf:"


@dataclass
class SourceRows:
    """Rows read from one source, column-wise and unvalidated.

    ``problem`` holds the bare problem, or (``templated``) the whole user message of a chat prompt, which may
    carry a prompt template; ``unreadable`` maps a row to why its prompt (or line) could not be read.
    """

    source: str
    loader: str
    problem: Column
    answer: Column
    data_source: Column
    ability: Column
    style: Column
    templated: bool
    digest: str
    unreadable: dict[int, str] = field(default_factory=dict)
    stamp: FileStamp | None = None  # the local file as it was read (dapo_core.data.freshness)

    def __len__(self) -> int:
        return len(self.problem)


LoaderFn = Callable[[SourceSpec], SourceRows]
_LOADERS: dict[str, LoaderFn] = {}


def register_loader(name: str) -> Callable[[LoaderFn], LoaderFn]:
    def wrap(fn: LoaderFn) -> LoaderFn:
        _LOADERS[name] = fn
        return fn

    return wrap


def available_loaders() -> list[str]:
    return sorted(_LOADERS)


def get_loader(name: str) -> LoaderFn:
    if name not in _LOADERS:
        raise ValueError(f"unknown source format {name!r}: use one of {available_loaders()} (or leave it null)")
    return _LOADERS[name]


def detect_format(spec: SourceSpec) -> str:
    """The loader for ``spec``: its ``format``, ``hf`` for 'hf:' ids, else from the suffix (and columns)."""
    if spec.format is not None:
        get_loader(spec.format)
        return spec.format
    if spec.path.startswith(HF_PREFIX):
        return "hf"
    suffix = Path(spec.path).suffix.lower()
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        names = set(pq.read_schema(_existing(spec)).names)
        return "verl" if {"prompt", "reward_model"} <= names else "parquet"
    by_suffix = {".jsonl": "jsonl", ".json": "jsonl", ".csv": "csv"}
    if suffix not in by_suffix:
        raise SchemaError(
            f"{spec.path}: cannot tell the format from the suffix {suffix!r}: use .parquet, .jsonl or .csv, "
            f"'hf:<dataset id>', or set the source's format to one of {available_loaders()}"
        )
    return by_suffix[suffix]


def load_source(spec: SourceSpec | str | os.PathLike[str]) -> SourceRows:
    """Read one source with its loader (see ``detect_format``); a local file that changes meanwhile is an error."""
    spec = SourceSpec.model_validate(spec)
    name = detect_format(spec)
    local = name != "hf" and Path(spec.path).is_file()
    before = file_stamp(spec.path) if local else None
    rows = get_loader(name)(spec)
    if before is not None:  # rewritten during the read: the rows may mix two versions of the file
        check_stamp(spec.path, before, "while it was being read")
        rows.stamp = before
    logger.info("read %d rows from %s (%s)", len(rows), spec.path, name)
    return rows


def _existing(spec: SourceSpec) -> Path:
    path = Path(spec.path)
    if not path.is_file():
        raise FileNotFoundError(
            f"{path}: no such source file (listed in curation.sources / curation.val_sources). Create it "
            "(the default synthetic file is made by `dapo data generate`) or fix the path"
        )
    return path


class _Rows:
    """Accumulates ``SourceRows`` columns over Arrow batches."""

    def __init__(self, spec: SourceSpec) -> None:
        self.spec = spec
        self.columns = {name: ColumnBuilder() for name in ("problem", "answer", "data_source", "ability", "style")}
        self.unreadable: dict[int, str] = {}

    def add(self, batch: pa.RecordBatch, **columns: Column | pa.Array | Any) -> None:
        n = batch.num_rows
        for name, value in columns.items():
            if not isinstance(value, Column):
                value = column_from_arrow(value) if isinstance(value, pa.Array) else Column.constant(value, n)
            self.columns[name].extend(value)

    def data_source(self, batch: pa.RecordBatch) -> pa.Array | str:
        if self.spec.data_source is not None:
            return self.spec.data_source
        if "data_source" in batch.schema.names:
            return pc.fill_null(batch.column("data_source"), DEFAULT_DATA_SOURCE)
        return DEFAULT_DATA_SOURCE

    def build(self, loader: str, templated: bool, digest: str) -> SourceRows:
        built = {name: builder.build() for name, builder in self.columns.items()}
        return SourceRows(
            source=self.spec.path,
            loader=loader,
            problem=built["problem"],
            answer=built["answer"],
            data_source=built["data_source"],
            ability=built["ability"],
            style=built["style"],
            templated=templated,
            digest=digest,
            unreadable=self.unreadable,
        )


def rows_from_verl_batches(
    schema: pa.Schema, batches: Iterable[pa.RecordBatch], spec: SourceSpec, loader: str, digest: str
) -> SourceRows:
    """``SourceRows`` of verl-schema batches: the user message (template included), reward_model.ground_truth."""
    where = spec.path
    require_columns(schema.names, ("prompt", "reward_model"), where, "the verl RL schema (prompt, reward_model, ...)")
    out = _Rows(spec)
    for batch in batches:
        problem, unreadable = last_user_message(batch.column("prompt"), where)
        out.unreadable.update({out.columns["problem"].size + i: why for i, why in unreadable.items()})
        has_style = batch.schema.field("reward_model").type.get_field_index("style") >= 0
        out.add(
            batch,
            problem=problem,
            answer=struct_field(batch, "reward_model", "ground_truth", where),
            data_source=out.data_source(batch),
            ability=batch.column("ability") if "ability" in batch.schema.names else None,
            style=struct_field(batch, "reward_model", "style", where) if has_style else None,
        )
    return out.build(loader, templated=True, digest=digest)


def rows_from_flat_batches(
    schema: pa.Schema, batches: Iterable[pa.RecordBatch], spec: SourceSpec, loader: str, digest: str
) -> SourceRows:
    """``SourceRows`` of problem/answer batches."""
    keys = (spec.problem_key, spec.answer_key)
    require_columns(schema.names, keys, spec.path, f"a problem column {keys[0]!r} and an answer column {keys[1]!r}")
    out = _Rows(spec)
    for batch in batches:
        out.add(
            batch,
            problem=batch.column(spec.problem_key),
            answer=batch.column(spec.answer_key),
            data_source=out.data_source(batch),
            ability=None,
            style=None,
        )
    return out.build(loader, templated=False, digest=digest)


def rows_from_table(table: pa.Table, spec: SourceSpec, loader: str, digest: str) -> SourceRows:
    """A whole table (csv, jsonl, a Hugging Face dataset): verl by its columns, else problem/answer."""
    verl = {"prompt", "reward_model"} <= set(table.column_names)
    build = rows_from_verl_batches if verl else rows_from_flat_batches
    return build(table.schema, table.to_batches(max_chunksize=BATCH_ROWS), spec, loader, digest)


VERL_READ_COLUMNS = ("data_source", "prompt", "ability", "reward_model")  # extra_info (raw_problem) is not read


def _parquet_batches(path: Path, columns: Sequence[str] | None) -> tuple[pa.Schema, Iterable[pa.RecordBatch]]:
    import pyarrow.parquet as pq

    file = pq.ParquetFile(path)
    names = file.schema_arrow.names
    wanted = [c for c in columns if c in names] if columns is not None else names
    return file.schema_arrow, file.iter_batches(batch_size=BATCH_ROWS, columns=wanted)


@register_loader("verl")
def load_verl_parquet(spec: SourceSpec) -> SourceRows:
    path = _existing(spec)
    schema, batches = _parquet_batches(path, VERL_READ_COLUMNS)
    return rows_from_verl_batches(schema, batches, spec, "verl", file_md5(path))


@register_loader("parquet")
def load_parquet(spec: SourceSpec) -> SourceRows:
    path = _existing(spec)
    columns = (spec.problem_key, spec.answer_key, "data_source")
    schema, batches = _parquet_batches(path, columns)
    return rows_from_flat_batches(schema, batches, spec, "parquet", file_md5(path))


@register_loader("csv")
def load_csv(spec: SourceSpec) -> SourceRows:
    """A CSV with a header; every cell is read as text (an empty cell is "", never a number or null)."""
    import pyarrow.csv as pcsv

    path = _existing(spec)
    with open(path, encoding="utf-8", errors="replace", newline="") as f:
        header = next(csv.reader(f), [])
    options = pcsv.ConvertOptions(column_types=dict.fromkeys(header, pa.string()), strings_can_be_null=False)
    try:
        table = pcsv.read_csv(path, convert_options=options)
    except pa.ArrowInvalid as exc:
        raise SchemaError(
            f"{path}: not a readable CSV file ({exc}); expected a header row and one problem per row"
        ) from exc
    return rows_from_table(table, spec, "csv", file_md5(path))


@register_loader("jsonl")
def load_jsonl(spec: SourceSpec) -> SourceRows:
    """One JSON object per line (blank lines skipped); a line that is not a JSON object is an unreadable row.

    A clean file (string fields) is parsed by Arrow's multi-threaded reader; anything it rejects (a bad line,
    a number where a string belongs) is re-read line by line, so each bad row gets its own reason.
    """
    path = _existing(spec)
    try:
        table = _arrow_jsonl(path, spec)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
        logger.debug("%s: Arrow reader declined (%s); reading line by line", path, exc)
        return _python_jsonl(path, spec)
    return rows_from_table(table, spec, "jsonl", file_md5(path))


def _arrow_jsonl(path: Path, spec: SourceSpec) -> pa.Table:
    import pyarrow.json as pjson

    fields = dict.fromkeys((spec.problem_key, spec.answer_key, "data_source"), pa.string())
    options = pjson.ParseOptions(explicit_schema=pa.schema(fields), unexpected_field_behavior="ignore")
    table = pjson.read_json(path, parse_options=options)
    for key in (spec.problem_key, spec.answer_key):  # declared fields always exist: a key on no line is an error
        if table.num_rows and table.column(key).null_count == table.num_rows:
            raise SchemaError(
                f"{path}: no line has the key(s) {[key]}; expected JSON objects with {spec.problem_key!r} and "
                f"{spec.answer_key!r}. Set the source's problem_key / answer_key to the file's keys"
            )
    return table


def _python_jsonl(path: Path, spec: SourceSpec) -> SourceRows:
    problem, answer, data_source = ColumnBuilder(), ColumnBuilder(), ColumnBuilder()
    unreadable: dict[int, str] = {}
    seen_keys = {spec.problem_key: False, spec.answer_key: False}
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            i = problem.size  # the row index (blank lines are not rows)
            try:
                row = json.loads(line)
            except ValueError as exc:
                row, why = None, f"line {number} is not JSON ({exc.__class__.__name__}: {str(exc)[:60]})"
            else:
                why = f"line {number} is a JSON {type(row).__name__}, not an object"
                row = {} if row is None else row  # `null`: no fields (as Arrow reads it)
            if not isinstance(row, dict):
                unreadable[i] = why
                row = {}
            for key in seen_keys:
                seen_keys[key] = seen_keys[key] or key in row
            problem.add(row.get(spec.problem_key))
            answer.add(row.get(spec.answer_key))
            source = row.get("data_source")
            data_source.add(DEFAULT_DATA_SOURCE if source is None else source)
    built = problem.build()
    n = len(built)
    missing = [k for k, seen in seen_keys.items() if not seen]
    if missing and n > len(unreadable):  # a wrong key name, not a few bad rows: say so once
        raise SchemaError(
            f"{path}: no line has the key(s) {missing}; expected JSON objects with {spec.problem_key!r} and "
            f"{spec.answer_key!r}. Set the source's problem_key / answer_key to the file's keys"
        )
    return SourceRows(
        source=spec.path,
        loader="jsonl",
        problem=built,
        answer=answer.build(),
        data_source=Column.constant(spec.data_source, n) if spec.data_source else data_source.build(),
        ability=Column.constant(None, n),
        style=Column.constant(None, n),
        templated=False,
        digest=file_md5(path),
        unreadable=unreadable,
    )


@register_loader("hf")
def load_hf_dataset(spec: SourceSpec) -> SourceRows:
    """A Hugging Face dataset (needs the ``datasets`` package and, unless cached, the network)."""
    dataset_id = spec.path.removeprefix(HF_PREFIX)
    try:
        import datasets
    except ImportError as exc:
        raise ImportError(
            f"source {spec.path!r}: reading a Hugging Face dataset needs the `datasets` package, which is not "
            "installed: `pip install datasets` (in .venv), or download the dataset's parquet file and list its "
            "local path in curation.sources instead"
        ) from exc
    ds = datasets.load_dataset(dataset_id, split=spec.split, revision=spec.revision)
    table = ds.with_format("arrow")[:]  # a pyarrow.Table
    digest = f"{dataset_id}@{spec.revision or 'default'}:{getattr(ds, '_fingerprint', 'unknown')}"
    return rows_from_table(table, spec, "hf", digest)
