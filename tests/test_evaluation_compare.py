"""dapo_core.evaluation.compare: curves overlaid into one PNG, final values in a markdown table (no MLflow)."""

from __future__ import annotations

import pytest

from dapo_core.evaluation.compare import compare_runs, default_metrics, final_metrics_table, final_value

HISTORIES = {
    "dapo": {
        "val/aime/acc/mean_at_32": [(0, 0.0), (10, 0.3), (5, 0.2)],  # unordered on purpose
        "actor/entropy": [(1, 0.9), (2, 0.8)],
        "actor/pg_clipfrac_high": [(1, 0.01)],
        "custom/x": [(1, 5.0)],
    },
    "grpo": {"val/aime/acc/mean_at_32": [(0, 0.0), (10, 0.1)], "actor/entropy": [(1, 0.5), (2, 0.1)]},
}


def test_default_metrics_pick_accuracy_first_then_known_curves():
    assert default_metrics(HISTORIES) == ["val/aime/acc/mean_at_32", "actor/entropy", "actor/pg_clipfrac_high"]


def test_final_value_is_the_last_step():
    assert final_value([(0, 0.0), (10, 0.3), (5, 0.2)]) == 0.3
    assert final_value([(3, 1.0), (3, 2.0)]) == 2.0  # same step twice: the later log wins
    assert final_value([]) is None


def test_table_and_png(tmp_path):
    table = final_metrics_table(HISTORIES)
    lines = table.splitlines()
    assert lines[0] == "| run | val/aime/acc/mean_at_32 | actor/entropy | actor/pg_clipfrac_high |"
    assert lines[2] == "| dapo | 0.3 | 0.8 | 0.01 |"
    assert lines[3] == "| grpo | 0.1 | 0.1 | n/a |"  # a metric the run never logged
    result = compare_runs(HISTORIES, tmp_path / "cmp", title="DAPO vs GRPO")
    assert result.png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and result.png.stat().st_size > 5000
    assert result.table_path.read_text() == table == result.table


def test_nothing_to_compare_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="no runs to compare"):
        compare_runs({}, tmp_path)
    with pytest.raises(ValueError, match="nothing to plot"):
        compare_runs({"a": {"custom/x": [(1, 1.0)]}}, tmp_path)
