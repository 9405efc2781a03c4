"""Prompt templates: the exact DAPO text, apply/strip round trips, detection, and the prompt token counter."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest
from conftest_data import aime_path
from hypothesis import given
from hypothesis import strategies as st

from dapo_core.data.templates import (
    DAPO_TEMPLATE,
    TINY_TEMPLATE,
    PromptTemplate,
    available_templates,
    chat_token_counter,
    detect_template,
    get_template,
    load_token_counter,
    strip_template,
)
from dapo_core.engines.tokenizer import DEFAULT_ALPHABET, build_char_tokenizer

problems = st.text(alphabet="abc XYZ 0123+-*/=?\n$\\{}", min_size=1, max_size=60).filter(lambda s: s.strip())


def test_dapo_template_is_the_published_instruction():
    assert DAPO_TEMPLATE.apply("P") == (
        "Solve the following math problem step by step. The last line of your response should be of the form "
        "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\nP\n\n"
        'Remember to put your answer on its own line after "Answer:".'
    )
    assert TINY_TEMPLATE.format == "Q: {problem}" and get_template("tiny") is TINY_TEMPLATE


def test_aime_prompts_are_the_dapo_template_around_raw_problem():
    table = pq.read_table(aime_path()).to_pylist()
    for row in table[:64]:
        content = row["prompt"][0]["content"]
        problem, name = strip_template(content)
        assert name == "dapo"
        assert problem == row["extra_info"]["raw_problem"].strip()
        assert DAPO_TEMPLATE.apply(problem) == content


@given(problems, st.sampled_from([DAPO_TEMPLATE, TINY_TEMPLATE]))
def test_apply_then_strip_round_trips(problem, template):
    assert strip_template(template.apply(problem)) == (problem.strip(), template.name)


def test_detection_prefers_the_most_specific_template_and_finds_empty_problems():
    assert detect_template(DAPO_TEMPLATE.apply("Q: 1+1")) is DAPO_TEMPLATE
    assert strip_template(DAPO_TEMPLATE.apply("   ")) == ("", "dapo")
    assert strip_template("Q:") == ("", "tiny")
    assert strip_template("  plain problem ") == ("plain problem", None)
    assert strip_template("Quick question") == ("Quick question", None)


def test_literal_templates_are_config():
    template = get_template("Problem: {problem}\nThink.")
    assert template.apply("1+1") == "Problem: 1+1\nThink." and template.extract("Problem: 2 \nThink.") == "2"
    with pytest.raises(ValueError, match=r"unknown prompt template 'nope': data.template must be one of \['dapo'"):
        get_template("nope")
    with pytest.raises(ValueError, match=r"must contain \{problem\} exactly once \(found 2\)"):
        PromptTemplate.from_format("{problem} {problem}")
    assert {"dapo", "tiny"} <= set(available_templates())


def test_char_token_counter_matches_the_chat_template_rendering():
    tok = build_char_tokenizer(DEFAULT_ALPHABET)
    count = chat_token_counter(tok)
    texts = ["Q: 71-57*6", "Q: 1+2", DAPO_TEMPLATE.apply("What is 1+1?")]
    rendered = [
        tok.apply_chat_template([{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True)
        for t in texts
    ]
    expected = [len(tok.encode(r, add_special_tokens=False)) for r in rendered]
    assert count(texts) == expected == [len(t) + 2 for t in texts]  # <|im_end|><|im_start|> close the turn
    assert load_token_counter("char")(texts) == expected


def test_counter_falls_back_to_rendering_each_message():
    tok = build_char_tokenizer(DEFAULT_ALPHABET, chat_template="{{ messages[0]['content'] | upper }}")
    assert chat_token_counter(tok)(["ab", "abc"]) == [2, 3]
