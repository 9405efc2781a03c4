"""The verl-schema writer (columnar, no pandas): round trips, types, determinism; read_rl_parquet reads it back."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
from conftest_data import aime_path

from dapo_core.data.schema import ProblemRecord, read_rl_parquet, rl_table, write_rl_parquet


def _records() -> list[ProblemRecord]:
    return [
        ProblemRecord("synthetic", [{"role": "user", "content": "Q: 1+2"}], "3", 0, "1+2", split="train"),
        ProblemRecord(
            "math_dapo",
            [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Q: 2*3"}],
            "6",
            1,
            "2*3",
            style="rule-lighteval/MATH_v2",
        ),
    ]


def test_rl_table_types_match_the_verl_schema():
    table = rl_table(_records())
    assert table.column_names == ["data_source", "prompt", "ability", "reward_model", "extra_info"]
    assert table.schema.field("prompt").type == pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
    assert table.schema.field("extra_info").type == pa.struct(
        [("index", pa.int64()), ("raw_problem", pa.string()), ("split", pa.string())]
    )
    assert table.to_pylist() == [r.to_row() for r in _records()]
    assert rl_table([]).num_rows == 0


def test_write_then_read_round_trips_and_is_byte_stable(tmp_path):
    a = write_rl_parquet(_records(), tmp_path / "a.parquet")
    b = write_rl_parquet(iter(_records()), tmp_path / "b.parquet")
    assert a.read_bytes() == b.read_bytes()
    assert [r.to_row() for r in read_rl_parquet(a)] == [r.to_row() for r in _records()]
    assert not (tmp_path / "a.parquet.tmp").exists()


def test_aime_records_survive_a_rewrite(tmp_path):
    records = read_rl_parquet(aime_path())[:64]
    path = write_rl_parquet(records, tmp_path / "aime.parquet")
    assert [r.to_row() for r in read_rl_parquet(path)] == [r.to_row() for r in records]
    assert pq.read_table(path).num_rows == 64
