"""The data card: statistics, the content digest, deterministic JSON + markdown, and the AIME fixture end to end."""

from __future__ import annotations

import json

from conftest_data import aime_path, char_count, rows

from dapo_core.data.card import (
    answer_magnitudes,
    build_card,
    dataset_digest,
    percentiles,
    render_markdown,
    write_card,
)
from dapo_core.data.curate import INTEGER_ANSWER, curate
from dapo_core.data.curate_report import DROP_REASONS
from dapo_core.data.loaders import load_source
from dapo_core.data.templates import load_token_counter


def test_percentiles_nearest_rank():
    assert percentiles([5, 1, 3, 2, 4]) == {"p0": 1.0, "p50": 3.0, "p90": 5.0, "p99": 5.0, "p100": 5.0, "mean": 3.0}
    assert percentiles(list(range(1, 101)))["p90"] == 90.0
    assert percentiles([]) == {"p0": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0, "p100": 0.0, "mean": 0.0}


def test_answer_magnitudes():
    hist = answer_magnitudes(["0", "-0", "7", "-42", "033", "999", "1000", "-123456"])
    assert hist == {"0": 2, "1-9": 1, "10-99": 2, "100-999": 1, "1000-9999": 1, ">=10000": 1, "negative": 2}


def _result(answers=("1", "22", "333")):
    src = rows([f"p{i}" for i in range(len(answers))], list(answers))
    return curate([src], template="tiny", max_prompt_length=99, count_tokens=char_count)


def test_card_is_deterministic_and_the_digest_follows_content(tmp_path):
    card = build_card(_result(), settings={"template": "tiny"})
    assert card["counts"]["rows_in"] == 3 and card["splits"]["train"]["prompt_tokens"]["p100"] == 5.0
    assert list(card["counts"]["dropped"]) == list(DROP_REASONS)
    a, b = (
        write_card(card, tmp_path / "a"),
        write_card(build_card(_result(), settings={"template": "tiny"}), tmp_path / "b"),
    )
    assert a[0].read_bytes() == b[0].read_bytes() and a[1].read_bytes() == b[1].read_bytes()
    assert json.loads(a[0].read_text()) == card
    other = _result(("1", "22", "334"))
    assert dataset_digest({"train": other.train}) != card["dataset_digest"]
    assert dataset_digest({"train": _result().train, "val": []}) == card["dataset_digest"]


def test_markdown_lists_every_reason_and_the_examples():
    src = rows(["a", "a", "b", ""], ["1", "1", "x", "2"])
    result = curate([src], template="tiny", max_prompt_length=99, count_tokens=char_count)
    text = render_markdown(build_card(result, settings={"template": "tiny"}))
    for reason in DROP_REASONS:
        assert f"| {reason} |" in text
    assert "rows in: 4 = kept 1 (train 1, val 0) + dropped 3" in text
    assert "| non_integer_answer | mem | 2 | answer 'x' normalises to 'x'" in text


def test_aime_960_rows_curate_to_30_integer_problems_with_the_template_detected():
    result = curate(
        [], [load_source(aime_path())], template="dapo", max_prompt_length=2048, count_tokens=load_token_counter()
    )
    card = build_card(result, settings={"template": "dapo"})
    assert (card["counts"]["rows_in"], card["counts"]["val"], card["counts"]["train"]) == (960, 30, 0)
    assert card["counts"]["dropped"]["duplicate"] == 930 and card["counts"]["dropped_total"] == 930
    assert card["sources"][0]["templates"] == {"dapo": 960}
    assert all(INTEGER_ANSWER.fullmatch(r.ground_truth) for r in result.val)
    assert len({r.raw_problem for r in result.val}) == 30
    assert all(r.prompt[0]["content"].startswith("Solve the following math problem") for r in result.val)
    assert 300 < card["splits"]["val"]["prompt_tokens"]["p50"] < 2048  # characters (+2) with the char tokenizer
