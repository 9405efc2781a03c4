"""Datasets: the verl RL schema, loaders, curation steps and the synthetic arithmetic task."""

from dapo_core.data.schema import (
    REQUIRED_COLUMNS,
    ProblemRecord,
    SchemaError,
    read_rl_files,
    read_rl_parquet,
    record_from_row,
    write_rl_parquet,
)

__all__ = [
    "REQUIRED_COLUMNS",
    "ProblemRecord",
    "SchemaError",
    "read_rl_files",
    "read_rl_parquet",
    "record_from_row",
    "write_rl_parquet",
]
