"""The ablation journal (dapo_core.evaluation.ablation_journal): what a resumed ablation may reuse, and what it must
not lose (a kill mid-write, a rerun without --resume)."""

from __future__ import annotations

import json

from dapo_core.evaluation.ablation_journal import AblationJournal, file_digest, fingerprint


def test_records_and_parent_survive_a_reopen(tmp_path):
    path = tmp_path / "ablation.journal.jsonl"
    j = AblationJournal.open(path, resume=True)
    assert len(j) == 0 and j.parent_run_id is None
    key = fingerprint({"run": {"lr": 1e-4}, "seed": 1})
    j.set_parent("parent-1")
    assert j.put(key, {"acc": 0.25, "run_id": "r1"}) == {"acc": 0.25, "run_id": "r1"}
    again = AblationJournal.open(path, resume=True)
    assert again.parent_run_id == "parent-1" and len(again) == 1
    assert again.get(key) == {"acc": 0.25, "run_id": "r1"} and again.reused == 1
    assert again.get(fingerprint({"run": {"lr": 2e-4}, "seed": 1})) is None and again.reused == 1


def test_a_line_cut_by_a_kill_is_skipped_and_the_rest_kept(tmp_path):
    path = tmp_path / "j.jsonl"
    j = AblationJournal.open(path, resume=True)
    j.put("a", {"acc": 0.1})
    j.put("b", {"acc": 0.2})
    text = path.read_text()
    path.write_text(text + text.splitlines()[0][:17])  # a third line, cut mid-write
    reopened = AblationJournal.open(path, resume=True)
    assert len(reopened) == 2 and reopened.get("b") == {"acc": 0.2}
    reopened.put("c", {"acc": 0.3})  # appending after the cut line still gives readable lines
    assert AblationJournal.open(path, resume=True).get("c") == {"acc": 0.3}


def test_without_resume_the_old_journal_is_set_aside_not_lost(tmp_path):
    path = tmp_path / "ablation.journal.jsonl"
    AblationJournal.open(path, resume=False).put("a", {"acc": 0.5})
    fresh = AblationJournal.open(path, resume=False)
    assert len(fresh) == 0 and not path.exists()
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("ablation.journal.") and p != path]
    assert len(aside) == 1
    assert json.loads(aside[0].read_text().splitlines()[0])["record"] == {"acc": 0.5}


def test_fingerprints_follow_content_not_order(tmp_path):
    assert fingerprint({"a": 1, "b": [1, 2]}) == fingerprint({"b": [1, 2], "a": 1})
    assert fingerprint({"a": 1}) != fingerprint({"a": 2})
    model = tmp_path / "model"
    model.mkdir()
    (model / "w.bin").write_bytes(b"\x00\x01")
    d1 = file_digest(model)
    (model / "w.bin").write_bytes(b"\x00\x02")  # changed weights: another digest, so no run is reused
    assert file_digest(model) != d1
    assert file_digest(tmp_path / "absent") == "missing"
    d2 = file_digest(model)
    (model / "extra.json").write_text("{}")  # a file more in the model directory: another digest
    assert file_digest(model) != d2


def test_knobs_added_later_keep_old_fingerprints_at_their_neutral_value():
    """A journal written before rollout.mode existed still resumes; a run that uses the knob does not match it."""
    from dapo_core.config import load_config
    from flows.ablation_runs import FINGERPRINT_NEUTRAL
    from flows.ablation_runs import config_view as _config_view

    neutral = [f"{section}.{key}={value}" for (section, key), value in FINGERPRINT_NEUTRAL.items()]
    view = _config_view(load_config(recipe="tiny-dapo", overrides=neutral, env={}))
    assert all(key not in view[section] for section, key in FINGERPRINT_NEUTRAL)  # what the older schema dumped
    assert "n" in view["rollout"] and "tracking" not in view
    off = _config_view(load_config(recipe="tiny-dapo", overrides=[*neutral, "rollout.mode=one_step_off"], env={}))
    assert off["rollout"]["mode"] == "one_step_off" and fingerprint(off) != fingerprint(view)


def test_the_decode_loop_is_part_of_a_runs_identity():
    """Journals written with generate (before rollout.hf_decode existed) still resume with generate; a run decoded
    by the static loop is another run (a flipped near-tie changes results by a sample), so it does not reuse them."""
    from dapo_core.config import load_config
    from flows.ablation_runs import config_view as _config_view

    def view(*overrides: str) -> dict:
        return _config_view(load_config(recipe="tiny-dapo", overrides=list(overrides), env={}))

    generate, static = view("rollout.hf_decode=generate"), view("rollout.hf_decode=static")
    assert "hf_decode" not in generate["rollout"]  # what the older schema dumped: old fingerprints still match
    assert static["rollout"]["hf_decode"] == "static" and fingerprint(static) != fingerprint(generate)
