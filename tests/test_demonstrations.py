"""Which demonstrations the warm start sees: an unlimited stream, a fixed set, or a scarce hard part."""

from __future__ import annotations

import itertools

import pytest
import torch

from dapo_core.config import BaseModelStageConfig, ConfigError, DemosConfig, load_config
from dapo_core.evaluation.metrics import stop_class
from dapo_core.warmstart.control import clean_settings, continue_warm_start, control_lr, warm_start_exclusions
from dapo_core.warmstart.sft import WarmStartConfig, demonstration_set, run_warm_start, sft_batches


def _questions(batches, n_batches):
    return [p for batch in itertools.islice(batches, n_batches) for p in batch]


def demos_config(**knobs) -> DemosConfig:
    """``base_model.demos`` of tiny-dapo with these knobs set on the command line (`--set base_model.demos.K=V`)."""
    return load_config(
        recipe="tiny-dapo", overrides=[f"base_model.demos.{k}={v}" for k, v in knobs.items()]
    ).base_model.demos


def test_fixed_demonstration_set_is_cycled_in_new_orders():
    seen = _questions(sft_batches(10, DemosConfig(num_demos=20), seed=3), 6)  # 60 problems = 3 epochs of 20
    epochs = [seen[i : i + 20] for i in range(0, 60, 20)]
    assert {p.question for p in epochs[0]} == {p.question for p in demonstration_set(20, seed=3, min_ops=1, max_ops=4)}
    assert all({p.question for p in e} == {p.question for p in epochs[0]} for e in epochs)
    assert [p.question for p in epochs[0]] != [p.question for p in epochs[1]]  # reshuffled each epoch


def test_fixed_demonstration_set_honours_exclusions():
    first = demonstration_set(30, seed=3, min_ops=1, max_ops=4)
    banned = [first[0].question, first[5].question]
    again = demonstration_set(30, seed=3, min_ops=1, max_ops=4, exclude=banned)
    assert not {q for q in banned} & {p.question for p in again}
    assert len({p.question for p in again}) == 30


def test_scarce_part_repeats_a_fixed_pool_and_keeps_the_mix():
    stream = _questions(sft_batches(50, DemosConfig(scarce_from_ops=4, scarce_demos=7), seed=4), 40)  # 2,000 problems
    hard = [p for p in stream if p.num_ops >= 4]
    assert len({p.question for p in hard}) == 7  # only the 7 worked solutions of 4-operation problems
    assert 0.2 < len(hard) / len(stream) < 0.3  # seen as often as each other operation count (uniform 1-4)
    easy = [p for p in stream if p.num_ops < 4]
    assert len({p.question for p in easy}) > 0.95 * len(easy)  # the easy part stays an unlimited supply


def test_scarce_settings_are_checked():
    with pytest.raises(ConfigError, match=r"base_model.demos.scarce_from_ops \(5\) must be <= max_ops \(4\)"):
        demos_config(scarce_from_ops=5, scarce_demos=3)
    with pytest.raises(ConfigError, match=r"base_model.demos.scarce_demos \(0\) must be >= 1"):
        demos_config(scarce_from_ops=4, scarce_demos=0)
    with pytest.raises(ConfigError, match=r"base_model.demos.num_demos \(0\) must be >= 1"):
        demos_config(num_demos=0)
    with pytest.raises(ConfigError, match=r"base_model.demos.min_ops \(3\) must be <= max_ops \(2\)"):
        demos_config(min_ops=3, max_ops=2)
    with pytest.raises(ValueError, match=r"scarce_from_ops \(5\) must be <= max_ops \(4\)"):  # built in Python too
        DemosConfig(scarce_from_ops=5, scarce_demos=3)


def test_config_carries_the_demonstration_knobs():
    demos = demos_config(scarce_from_ops=3, scarce_demos=9)
    assert (demos.scarce_from_ops, demos.scarce_demos) == (3, 9)


@pytest.mark.parametrize("knob", ["min_ops", "max_ops", "num_demos", "scarce_from_ops", "scarce_demos", "shortcut_frac",
                                  "shortcut_style", "run_on_frac", "run_on_style", "check_frac"])  # fmt: skip
def test_an_old_flat_demonstration_key_names_its_new_place(knob, tmp_path):
    """base_model.<knob> moved to base_model.demos.<knob> (issue 44): given the old way, on the command line or in
    YAML, it is an error that names the new key, never a setting silently ignored."""
    from flows.base_model import warm_start_settings

    new = f"base_model.demos.{knob}"
    with pytest.raises(ConfigError, match=rf"^base_model.{knob} moved to {new}: use --set {new}=VALUE"):
        load_config(recipe="tiny-dapo", overrides=[f"base_model.{knob}=1"])
    old_yaml = tmp_path / "old.yaml"
    old_yaml.write_text(f"inherit: tiny-dapo\nbase_model:\n  steps: 5\n  {knob}: 1\n")
    with pytest.raises(
        ConfigError,
        match=rf"old.yaml: base_model.{knob} moved to {new}: .*put `{knob}:` under `demos:` in `base_model:`",
    ):
        load_config(old_yaml)
    with pytest.raises(ConfigError, match=rf"^base_model.{knob} moved to {new}"):  # a stage knob: the same message
        warm_start_settings(load_config(recipe="tiny-dapo"), **{knob: 1})


def test_control_trains_on_from_the_base_model(tmp_path):
    """The control starts from the saved base, takes its step budget, and saves a model that differs from it."""
    from safetensors.torch import load_file

    cfg = load_config(
        recipe="tiny-dapo",
        overrides=["model.tiny.hidden_size=32", "model.tiny.num_hidden_layers=1", "model.tiny.intermediate_size=64"],
    )
    ws = WarmStartConfig.from_config(
        BaseModelStageConfig(), seed=42, max_new_tokens=64, steps=3, batch_size=8, micro_batch_size=8,
        heldout_size=2, heldout_k=1, demos={"scarce_from_ops": 4, "scarce_demos": 2},
    )  # fmt: skip
    base = run_warm_start(cfg, ws, output_dir=tmp_path / "base")
    assert base.output_dir is not None
    result = continue_warm_start(cfg, ws, base.output_dir, max_steps=2, output_dir=tmp_path / "control")
    assert result.steps == 2 and result.final_loss > 0
    before = load_file(str(tmp_path / "base" / "model.safetensors"))
    after = load_file(str(tmp_path / "control" / "model.safetensors"))
    assert before.keys() == after.keys()
    assert any(not (before[k] == after[k]).all() for k in before)
    # the exclusions it rebuilds are the warm start's: its held-out problems are among them
    assert len(warm_start_exclusions(ws, ["1+2"])) == 1 + ws.heldout_size
    with pytest.raises(ValueError, match="needs a budget"):
        continue_warm_start(cfg, ws, base.output_dir)
    # a CPU-time budget stops it: half the CPU seconds 3 steps took buys 1 to 3 steps, not the 50 allowed
    three = continue_warm_start(cfg, ws, base.output_dir, max_steps=3)
    assert three.steps == 3 and three.cpu_s > 0
    half = continue_warm_start(cfg, ws, base.output_dir, cpu_budget_s=three.cpu_s / 2, max_steps=50)
    assert 1 <= half.steps <= 3 and half.cpu_s >= three.cpu_s / 2
    with pytest.raises(ValueError, match=r"cpu_budget_s \(0\) must be > 0"):
        continue_warm_start(cfg, ws, base.output_dir, cpu_budget_s=0)
    # its seeds train on other batches of the same stream: seed 2 starts one warm-start length (3 batches) further,
    # the same weights as seed 1 told to skip 6 batches, and not seed 1's
    weights = {}
    for name, kwargs in {"s1": {}, "s2": {"seed": 2}, "s1-skip6": {"skip_steps": 6}}.items():
        continue_warm_start(cfg, ws, base.output_dir, max_steps=2, output_dir=tmp_path / name, **kwargs)
        weights[name] = load_file(str(tmp_path / name / "model.safetensors"))
    assert all(torch.equal(weights["s2"][k], weights["s1-skip6"][k]) for k in before)
    assert any(not torch.equal(weights["s2"][k], weights["s1"][k]) for k in before)
    with pytest.raises(ValueError, match=r"seed \(0\) must be >= 1"):
        continue_warm_start(cfg, ws, base.output_dir, max_steps=1, seed=0)


def test_clean_control_trains_on_demonstrations_that_stop_at_their_answer_line(tmp_path, monkeypatch):
    """sft-control keeps the warm start's habits (run-ons, shortcuts); sft-control-clean (clean=True) sees none of
    them, at its own lr; both see the same problems' worked solutions otherwise."""
    import dapo_core.warmstart.control as control_mod

    cfg = load_config(
        recipe="tiny-dapo",
        overrides=["model.tiny.hidden_size=32", "model.tiny.num_hidden_layers=1", "model.tiny.intermediate_size=64"],
    )
    ws = WarmStartConfig.from_config(
        BaseModelStageConfig(), seed=42, max_new_tokens=64, steps=2, batch_size=16, micro_batch_size=16,
        heldout_size=2, heldout_k=1,
        demos={"run_on_frac": 0.6, "run_on_style": "answer_only", "shortcut_frac": 0.3},
    )  # fmt: skip
    base = run_warm_start(cfg, ws, output_dir=tmp_path / "base")
    seen: list[str] = []
    real = control_mod.response_ids
    monkeypatch.setattr(control_mod, "response_ids", lambda tok, text: seen.append(text) or real(tok, text))

    def classes(**kwargs) -> tuple[set[str], int, float]:
        seen.clear()
        res = continue_warm_start(cfg, ws, base.output_dir, max_steps=4, **kwargs)
        shortcuts = sum(t.startswith("Answer:") for t in seen)  # answer_only shortcuts: the answer line alone
        return {stop_class(t) for t in seen}, shortcuts, res.lr

    habit, habit_shortcuts, habit_lr = classes()
    assert habit == {"stopped", "run_on"} and habit_shortcuts > 0 and habit_lr == pytest.approx(control_lr(ws))
    clean, clean_shortcuts, clean_lr = classes(clean=True, lr=3e-4)
    assert clean == {"stopped"} and clean_shortcuts == 0 and clean_lr == 3e-4
    clean_demos = clean_settings(ws).demos
    assert (clean_demos.run_on_frac, clean_demos.shortcut_frac) == (0.0, 0.0)
    assert clean_demos.run_on_style == ws.demos.run_on_style and clean_demos.scarce_from_ops == ws.demos.scarce_from_ops
    assert clean_settings(ws).model_dump(exclude={"demos"}) == ws.model_dump(exclude={"demos"})
    with pytest.raises(ValueError, match=r"lr \(0\.0\) must be > 0"):
        continue_warm_start(cfg, ws, base.output_dir, max_steps=1, lr=0.0)


def test_shortcut_share_of_demonstrations_shows_only_the_answer_line():
    stream = _questions(sft_batches(50, DemosConfig(shortcut_frac=0.5), seed=6), 40)  # 2,000 problems
    bare = [p for p in stream if "\n" not in p.solution]
    assert 0.45 < len(bare) / len(stream) < 0.55
    assert all(p.solution == f"Answer: {p.answer}" for p in bare)
    worked = [p for p in stream if "\n" in p.solution]
    assert all(len(p.solution.splitlines()) == p.num_ops + 1 for p in worked)
    # same seed, same stream: the warm start and its supervised control see the same demonstrations
    assert [p.solution for p in _questions(sft_batches(50, DemosConfig(shortcut_frac=0.5), seed=6), 40)] == [
        p.solution for p in stream
    ]
    with pytest.raises(ConfigError, match=r"base_model.demos.shortcut_frac \(1.0\) must be in \[0, 1\)"):
        demos_config(shortcut_frac=1.0)


def test_answer_first_shortcuts_state_the_answer_then_the_same_work():
    plain = _questions(sft_batches(50, DemosConfig(), seed=6), 20)
    mixed = _questions(sft_batches(50, DemosConfig(shortcut_frac=0.5, shortcut_style="answer_first"), seed=6), 20)
    assert [p.question for p in mixed] == [p.question for p in plain]  # same problems, only the order of lines
    flipped = [(m, p) for m, p in zip(mixed, plain, strict=True) if m.solution != p.solution]
    assert 0.4 < len(flipped) / len(mixed) < 0.6
    for m, p in flipped:
        *work, answer = p.solution.splitlines()
        assert m.solution.splitlines() == [answer, *work]  # the answer line first, then every worked line
        assert answer == f"Answer: {p.answer}"
    with pytest.raises(
        ConfigError, match=r"base_model.demos.shortcut_style \('later'\) must be one of .*'answer_first'"
    ):
        demos_config(shortcut_frac=0.5, shortcut_style="later")


def test_run_on_demonstrations_go_on_to_the_next_problem_and_score_wrong():
    from dapo_core.rewards import math_dapo_score

    plain = _questions(sft_batches(50, DemosConfig(), seed=6), 30)
    mixed = _questions(sft_batches(50, DemosConfig(run_on_frac=0.4), seed=6), 20)
    run_ons = [p for p in mixed if "\nQ: " in p.solution]
    # a share r = 0.4 of the demonstrations run on (each uses up the problem it goes on to)
    assert 0.3 < len(run_ons) / len(mixed) < 0.5
    stream = iter(plain)
    for p in mixed:  # the same problems in the same order, each run-on followed by the next one
        own = next(stream)
        assert p.question == own.question
        if "\nQ: " in p.solution:
            nxt = next(stream)
            first, rest = p.solution.split("\nQ: ")
            assert first == own.solution  # its own worked solution, answer line last
            assert rest == f"{nxt.question}\n{nxt.solution}"
            # the scorer reads the last answer line: the next problem's, so a run-on is wrong on its own problem
            assert math_dapo_score(p.solution, str(nxt.answer))["acc"] is True
            assert (math_dapo_score(p.solution, str(p.answer))["acc"] is True) == (p.answer == nxt.answer)
    with pytest.raises(ConfigError, match=r"base_model.demos.run_on_frac \(1.5\) must be in \[0, 1\)"):
        demos_config(run_on_frac=1.5)


def test_short_run_ons_give_the_next_question_and_its_answer_line_only():
    from dapo_core.rewards import math_dapo_score

    plain = iter(_questions(sft_batches(50, DemosConfig(), seed=6), 40))
    mixed = _questions(sft_batches(50, DemosConfig(run_on_frac=0.6, run_on_style="answer_only"), seed=6), 20)
    short = 0
    for p in mixed:
        own = next(plain)
        assert p.question == own.question
        if p.solution != own.solution:
            nxt = next(plain)
            assert p.solution == f"{own.solution}\nQ: {nxt.question}\nAnswer: {nxt.answer}"
            assert (math_dapo_score(p.solution, str(p.answer))["acc"] is True) == (p.answer == nxt.answer)
            short += 1
    assert 0.55 < short / len(mixed) < 0.65  # a share r = 0.6 of the demonstrations run on
    with pytest.raises(ConfigError, match=r"base_model.demos.run_on_style \('tail'\) must be one of .*'answer_only'"):
        demos_config(run_on_frac=0.5, run_on_style="tail")


def test_default_soft_overlong_window_starts_above_every_correct_answer():
    """Eq. 13 must punish only overlong work: on the tiny task no correct answer may reach the penalty window."""
    from dapo_core.data.synthetic import generate_problems
    from dapo_core.engines.tokenizer import DEFAULT_ALPHABET, build_char_tokenizer
    from dapo_core.warmstart.sft import response_ids

    cfg = load_config(recipe="tiny-dapo")
    tok = build_char_tokenizer(DEFAULT_ALPHABET)
    longest = max(len(response_ids(tok, p.solution)) for p in generate_problems(5000, seed=0, min_ops=4))
    assert longest >= 55  # 4-operation answers are the long tail the window must clear
    assert cfg.data.max_response_length - cfg.algorithm.overlong.buffer_length > longest


def test_check_demonstrations_check_every_worked_line_and_keep_the_answer():
    from dapo_core.rewards import math_dapo_score
    from dapo_core.warmstart.demos import check_demo, check_line

    assert check_line("57*6=342") == "check 6*57=342"
    assert check_line("-184-43=-227") == "check -227+43=-184"
    assert check_line("-58+11=-47") == "check -47-11=-58"
    with pytest.raises(ValueError, match="not a worked step line 'Answer: 3'"):
        check_line("Answer: 3")
    plain = _questions(sft_batches(50, DemosConfig(), seed=6), 20)
    mixed = _questions(sft_batches(50, DemosConfig(check_frac=0.4), seed=6), 20)
    checked = 0
    for own, p in zip(plain, mixed, strict=True):  # the same problems in the same order: no problem is used up
        assert p.question == own.question
        if p.solution == own.solution:
            continue
        checked += 1
        assert p.solution == check_demo(own).solution
        *work, answer = own.solution.splitlines()
        lines = p.solution.splitlines()
        assert lines[: len(work)] == work and lines[-1] == answer  # worked lines first, the answer line last
        checks = lines[len(work) : -1]
        assert len(checks) == len(work) == own.num_ops
        for check in checks:  # each check is a true equation
            lhs, rhs = check.removeprefix("check ").split("=")
            assert eval(lhs) == int(rhs), check  # the line holds digits and + - * only
        assert math_dapo_score(p.solution, str(p.answer))["acc"] is True
    assert 0.3 < checked / len(mixed) < 0.5  # a share c = 0.4 of the demonstrations check
    with pytest.raises(ConfigError, match=r"base_model.demos.check_frac \(1.0\) must be in \[0, 1\)"):
        demos_config(check_frac=1.0)


def test_checked_answers_of_hard_problems_pass_the_default_length_limit():
    """With checks the length is the policy's choice: hard problems then hit max_response_length (80)."""
    from dapo_core.data.synthetic import generate_problems
    from dapo_core.engines.tokenizer import DEFAULT_ALPHABET, build_char_tokenizer
    from dapo_core.warmstart.demos import check_demo
    from dapo_core.warmstart.sft import response_ids

    tok = build_char_tokenizer(DEFAULT_ALPHABET)
    limit = load_config(recipe="tiny-dapo").data.max_response_length
    for ops, share_over in ((1, 0.0), (4, 1.0)):
        problems = generate_problems(200, seed=11, min_ops=ops, max_ops=ops)
        assert all(len(response_ids(tok, p.solution)) <= limit - 16 for p in problems)  # no check: below the window
        over = sum(len(response_ids(tok, check_demo(p).solution)) > limit for p in problems) / len(problems)
        assert over == share_over, ops


def test_check_frac_enters_the_warm_start_stamp_only_when_set():
    """At its default the stamp is the one base models were built under before the knob existed (no rebuild)."""
    from flows.base_model import warm_start_settings

    cfg = load_config(recipe="tiny-dapo")
    ws = warm_start_settings(cfg)
    assert "check_frac" not in ws.stamp() and "run_on_frac" in ws.stamp()
    checks = load_config(recipe="tiny-dapo", overrides=["base_model.demos.check_frac=0.5"])
    assert warm_start_settings(checks).stamp() == {**ws.stamp(), "check_frac": 0.5}
