"""Source loaders: every format to the same SourceRows; file-level problems are clear errors naming the file."""

from __future__ import annotations

import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest_data import MESSY_JSONL_REASONS, aime_path, messy_jsonl

from dapo_core.data.loaders import (
    ColumnBuilder,
    SourceSpec,
    available_loaders,
    column_from_arrow,
    detect_format,
    get_loader,
    load_source,
)
from dapo_core.data.schema import SchemaError

PROBLEMS = ["1+2", "3*4", "1+2"]
ANSWERS = ["3", "12", "3"]


def _values(rows, name):
    column = getattr(rows, name)
    return [column.row(i) for i in range(len(column))]


def test_flat_formats_read_the_same_rows(tmp_path):
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text(
        "".join(json.dumps({"problem": p, "answer": a}) + "\n" for p, a in zip(PROBLEMS, ANSWERS, strict=True))
    )
    csv = tmp_path / "p.csv"
    csv.write_text("problem,answer\n" + "".join(f'"{p}",{a}\n' for p, a in zip(PROBLEMS, ANSWERS, strict=True)))
    parquet = tmp_path / "p.parquet"
    pq.write_table(pa.table({"problem": PROBLEMS, "answer": ANSWERS}), parquet)
    for path, loader in ((jsonl, "jsonl"), (csv, "csv"), (parquet, "parquet")):
        rows = load_source(path)
        assert rows.loader == loader and not rows.templated and len(rows) == 3
        assert _values(rows, "problem") == PROBLEMS
        assert _values(rows, "answer") == ANSWERS  # csv cells stay text: "3", never the number 3
        assert _values(rows, "data_source") == ["math_dapo"] * 3
        assert len(rows.problem.values) == 2  # stored once per distinct value
        assert len(rows.digest) == 32


def test_jsonl_fast_and_line_by_line_readers_agree(tmp_path, monkeypatch):
    from dapo_core.data import loaders

    path = tmp_path / "p.jsonl"
    lines = [{"problem": "1+2", "answer": "3", "solution": "x"}, {"problem": "2024-01-01", "answer": "-4"},
             {"answer": "5"}, {"problem": "7", "answer": "7", "data_source": "other"}, None]  # fmt: skip
    path.write_text("\n\n".join(json.dumps(line) for line in lines) + "\n")  # blank lines are not rows
    fast = load_source(path)

    def declined(*_):
        raise pa.ArrowInvalid("declined")

    monkeypatch.setattr(loaders, "_arrow_jsonl", declined)
    slow = load_source(path)
    for name in ("problem", "answer", "data_source"):
        assert _values(fast, name) == _values(slow, name)
    assert _values(fast, "problem") == ["1+2", "2024-01-01", None, "7", None]  # strings stay strings
    assert _values(fast, "data_source") == ["math_dapo", "math_dapo", "math_dapo", "other", "math_dapo"]
    assert fast.unreadable == slow.unreadable == {}


def test_empty_source_curates_to_nothing(tmp_path):
    from conftest_data import char_count

    from dapo_core.data.curate import curate

    path = tmp_path / "empty.jsonl"
    path.write_text("")
    result = curate([load_source(path)], template="tiny", max_prompt_length=9, count_tokens=char_count)
    assert (result.report.rows_in, result.train, result.val) == (0, [], [])


def test_custom_keys_and_data_source(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text(json.dumps({"question": "2+2", "solution_value": "4"}) + "\n")
    spec = SourceSpec(path=str(path), problem_key="question", answer_key="solution_value", data_source="arith")
    rows = load_source(spec)
    assert (_values(rows, "problem"), _values(rows, "answer"), _values(rows, "data_source")) == (
        ["2+2"],
        ["4"],
        ["arith"],
    )


def test_jsonl_bad_lines_are_rows_not_errors(tmp_path):
    rows = load_source(messy_jsonl(tmp_path / "m.jsonl"))
    assert len(rows) == len(MESSY_JSONL_REASONS)
    assert list(rows.unreadable) == [1] and "not JSON" in rows.unreadable[1]
    assert rows.answer.row(2) is None and rows.answer.row(3) == 6


def test_missing_column_names_file_column_and_fix(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text("question,answer\n1+1,2\n")
    with pytest.raises(SchemaError, match=r"bad.csv: missing column\(s\) \['problem'\].*problem_key"):
        load_source(path)
    jsonl = tmp_path / "bad.jsonl"
    jsonl.write_text(json.dumps({"q": "1+1", "answer": "2"}) + "\n")
    with pytest.raises(SchemaError, match=r"bad.jsonl: no line has the key\(s\) \['problem'\]"):
        load_source(jsonl)


def test_verl_prompt_column_of_the_wrong_type(tmp_path):
    path = tmp_path / "v.parquet"
    pq.write_table(pa.table({"prompt": ["plain text"], "reward_model": [{"ground_truth": "1"}]}), path)
    with pytest.raises(SchemaError, match=r"v.parquet: column 'prompt' has type string; expected list<struct"):
        load_source(path)


def test_unreadable_verl_prompts_say_why(tmp_path):
    from conftest_data import VERL_SCHEMA, verl_row

    rows_in = [
        verl_row("fine", "1"),
        {**verl_row(None, "1"), "prompt": None},
        verl_row(None, "1", messages=[]),
        verl_row(None, "1"),  # a user message whose content is null
        verl_row(None, "1", messages=[{"role": "user", "content": "first"}, {"role": "user", "content": "last"}]),
    ]
    path = tmp_path / "v.parquet"
    pq.write_table(pa.Table.from_pylist(rows_in, schema=VERL_SCHEMA), path)
    rows = load_source(path)
    assert rows.unreadable == {
        1: "prompt is null",
        2: "prompt has no user message",
        3: "the user message has no content",
    }
    assert _values(rows, "problem") == ["fine", None, None, None, "last"]


def test_missing_file_and_unknown_format(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nope.jsonl: no such source file .*dapo data generate"):
        load_source(tmp_path / "nope.jsonl")
    with pytest.raises(SchemaError, match=r"cannot tell the format from the suffix '.txt'"):
        load_source(tmp_path / "x.txt")
    with pytest.raises(ValueError, match=r"unknown source format 'xml': use one of \["):
        detect_format(SourceSpec(path="a.xml", format="xml"))
    assert set(available_loaders()) == {"csv", "hf", "jsonl", "parquet", "verl"}


def test_hf_dataset_needs_datasets_package():
    pytest.importorskip("pyarrow")
    try:
        import datasets  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("`datasets` is installed: the network path would be tried")
    spec = SourceSpec(path="hf:BytedTsinghua-SIA/DAPO-Math-17k")
    assert detect_format(spec) == "hf"
    with pytest.raises(ImportError, match=r"DAPO-Math-17k.*`pip install datasets`"):
        get_loader("hf")(spec)


def test_column_encoding_keeps_types_apart():
    builder = ColumnBuilder()
    for value in [1, True, 1.0, "1", None, [1], [1], "1"]:
        builder.add(value)
    column = builder.build()
    assert [column.row(i) for i in range(8)] == [1, True, 1.0, "1", None, [1], [1], "1"]
    assert column.codes[3] == column.codes[7] and column.codes[0] != column.codes[1]
    arrow = column_from_arrow(pa.chunked_array([["a", None], ["a", "b"]]))
    assert [arrow.row(i) for i in range(4)] == ["a", None, "a", "b"]
    assert arrow.codes.dtype == np.int64 and len(arrow.values) == 3


def test_aime_reads_as_verl_with_its_template():
    rows = load_source(aime_path())
    assert (rows.loader, rows.templated, len(rows), rows.unreadable) == ("verl", True, 960, {})
    assert rows.problem.row(0).startswith("Solve the following math problem step by step.")
    assert rows.style.row(0) == "rule-lighteval/MATH_v2" and rows.ability.row(0) == "MATH"


def test_a_source_rewritten_while_or_after_it_is_read_is_caught(tmp_path, monkeypatch):
    from dapo_core.data import loaders
    from dapo_core.data.freshness import SourceChangedError, check_unchanged

    path = tmp_path / "p.jsonl"
    path.write_text(
        "".join(json.dumps({"problem": p, "answer": a}) + "\n" for p, a in zip(PROBLEMS, ANSWERS, strict=True))
    )
    rows = load_source(path)
    assert rows.stamp is not None and rows.stamp.size == path.stat().st_size
    check_unchanged([rows])  # untouched: no error

    real = loaders._LOADERS["jsonl"]

    def rewritten_during_the_read(spec):
        out = real(spec)
        path.write_text(path.read_text().replace("3*4", "13*4"))
        return out

    monkeypatch.setitem(loaders._LOADERS, "jsonl", rewritten_during_the_read)
    with pytest.raises(SourceChangedError, match=r"p\.jsonl: the source file changed while it was being read"):
        load_source(path)
    monkeypatch.setitem(loaders._LOADERS, "jsonl", real)

    rows = load_source(path)
    replacement = tmp_path / "new.jsonl"
    replacement.write_bytes(path.read_bytes())
    replacement.replace(path)  # the same bytes, renamed over it: another file (inode)
    with pytest.raises(SourceChangedError, match=r"after it was read.*Nothing was written"):
        check_unchanged([rows])
    rows = load_source(path)
    with open(path, "r+") as f:  # same size, maybe within the same clock tick as the read: the md5 tells
        text = f.read()
        f.seek(0)
        f.write(text.replace("3*4", "5*6"))
    os.utime(path, ns=(rows.stamp.mtime_ns, rows.stamp.mtime_ns))
    with pytest.raises(SourceChangedError, match="after it was read"):
        check_unchanged([rows])
    path.unlink()
    with pytest.raises(SourceChangedError, match="now gone"):
        check_unchanged([rows])
