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
    from dapo_core.config import MOVED_KEYS, load_config
    from flows.ablation_runs import FINGERPRINT_NEUTRAL
    from flows.ablation_runs import config_view as _config_view

    def now(dotted: str) -> str:  # the view keeps the older, flat base_model: its keys as the config spells them now
        return MOVED_KEYS.get(dotted, dotted)

    neutral = [f"{now(f'{section}.{key}')}={value}" for (section, key), value in FINGERPRINT_NEUTRAL.items()]
    view = _config_view(load_config(recipe="tiny-dapo", overrides=neutral, env={}))
    assert all(key not in view[section] for section, key in FINGERPRINT_NEUTRAL)  # what the older schema dumped
    # base_model.demos is viewed flat, as journals were keyed before it existed: the same config, the same key
    assert "demos" not in view["base_model"] and view["base_model"]["run_on_frac"] == 0.6
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


# ------------------------------------------------------------------------------------------------ runs know their code
def _fake_project(root):
    """A small stand-in checkout: the three code packages, docs, tests and a recipe."""
    for rel, text in {
        "dapo_core/__init__.py": "",
        "dapo_core/algorithm/loss.py": "def loss(x):\n    return x\n",
        "dapo_core/README.md": "# notes\n",
        "tasks/__init__.py": "",
        "flows/train.py": "STEPS = 1\n",
        "flows/services/stack.py": "PORT = 1\n",
        "docs/guide.md": "# guide\n",
        "tests/test_x.py": "def test_x():\n    pass\n",
        "recipes/tiny.yaml": "lr: 1\n",
    }.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_the_code_digest_follows_the_package_sources_not_the_docs(tmp_path):
    """code_digest hashes the .py files of dapo_core, tasks and flows (paths and bytes): an edit to the algorithm
    changes it; docs, markdown, tests, recipes (in the key as the resolved config), __pycache__ and the local
    services (flows/services) do not."""
    from dapo_core.evaluation.ablation_journal import code_digest, code_files

    root = _fake_project(tmp_path / "proj")
    assert [f.relative_to(root).as_posix() for f in code_files(root)] == [
        "dapo_core/__init__.py", "dapo_core/algorithm/loss.py", "flows/train.py", "tasks/__init__.py",
    ]  # fmt: skip
    before = code_digest(root)
    assert len(before) == 64 and code_digest(root) == before  # cached per process and root
    for rel in (
        "docs/guide.md",
        "dapo_core/README.md",
        "tests/test_x.py",
        "recipes/tiny.yaml",
        "flows/services/stack.py",
    ):
        (root / rel).write_text("changed\n")
    (root / "dapo_core/__pycache__").mkdir()
    (root / "dapo_core/__pycache__/loss.cpython-311.py").write_text("stale")
    code_digest.cache_clear()
    assert code_digest(root) == before
    (root / "dapo_core/algorithm/loss.py").write_text("def loss(x):\n    return -x\n")  # the algorithm changed
    code_digest.cache_clear()
    changed = code_digest(root)
    assert changed != before
    (root / "dapo_core/algorithm/loss.py").rename(root / "dapo_core/algorithm/loss2.py")  # same bytes, moved
    code_digest.cache_clear()
    assert code_digest(root) not in (before, changed)
    (root / "flows/extra.py").write_text("")  # a new module counts too
    code_digest.cache_clear()
    moved = code_digest(root)
    (root / "flows/extra.py").unlink()
    code_digest.cache_clear()
    assert code_digest(root) != moved
    code_digest.cache_clear()
    assert len(code_digest()) == 64  # this checkout


def test_the_code_that_trains_and_evaluates_does_not_import_the_local_services():
    """What lets code_digest leave out flows/services: no module it hashes imports them, except the CLI (which starts
    the services and the subprocess reaper, and has no say in a run's result)."""
    import ast

    from dapo_core.evaluation.ablation_journal import CODE_EXCLUDED, PROJECT_ROOT, code_files

    excluded = [ex.replace("/", ".") for ex in CODE_EXCLUDED]
    hashed = code_files()
    assert any(f.relative_to(PROJECT_ROOT).as_posix() == "flows/train.py" for f in hashed)
    offenders = []
    for f in hashed:
        rel = f.relative_to(PROJECT_ROOT).as_posix()
        if rel.startswith("flows/cli/"):
            continue
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            else:
                continue
            offenders += [f"{rel}: {n}" for n in names if any(n == ex or n.startswith(f"{ex}.") for ex in excluded)]
    assert offenders == []


def _reuse(journal, key: str, config_key: str, code: str):
    from dapo_core.config import load_config
    from flows.ablation_runs import reuse_journaled

    cfg = load_config(recipe="tiny-dapo", env={})
    return reuse_journaled(
        {}, cfg, journal, key=key, default_model_dir="unused", k=8, run_name="ablation-tuned-dapo-s1", tags={},
        config_key=config_key, code=code,
    )  # fmt: skip


def test_a_resume_after_a_code_change_trains_again_and_says_so(tmp_path, caplog):
    """A journaled run of the same config, base model and data is reused only when the same code trained it; a run
    from other code, or a line from before code digests (the committed journals), is trained again and counted."""
    import logging

    from flows.ablation_runs import announce_code_changes, run_keys

    parts = {"kind": "train", "run": {"lr": 1e-4}, "base": "b", "data": {}, "eval": {}}
    old_code, new_code = "a" * 64, "b" * 64
    path = tmp_path / "ablation.journal.jsonl"
    journal = AblationJournal.open(path, resume=True)
    # a line from before code digests: keyed by the parts alone, no code_digest in the record
    journal.put(fingerprint(parts), {"run_id": "legacy", "acc": 0.3, "eval_k": 8, "git_sha": "f9cf14a"})
    other = {**parts, "run": {"lr": 2e-4}}
    key_o, cfg_o = run_keys(other, old_code)
    journal.put(key_o, {"run_id": "old", "acc": 0.4, "eval_k": 8, "code_digest": old_code}, config_key=cfg_o)

    journal = AblationJournal.open(path, resume=True)
    with caplog.at_level(logging.INFO, logger="flows.ablation_runs"):
        assert announce_code_changes(journal, new_code) == 2
        key, config_key = run_keys(parts, new_code)
        assert key != config_key == fingerprint(parts)  # the old line's key is the new config_key
        assert _reuse(journal, key, config_key, new_code) is None  # the legacy run: trained again
        key_n, cfg_n = run_keys(other, new_code)
        assert _reuse(journal, key_n, cfg_n, new_code) is None  # trained by old_code: trained again
    assert journal.retrained_for_code == 2 and journal.reused == 0
    text = caplog.text
    assert f"2 journaled run(s) were trained by other code (digest {'a' * 12}, none != {'b' * 12})" in text
    assert "the journaled run legacy was trained by other code (digest none != bbbbbbbbbbbb)" in text
    assert "the journaled run old was trained by other code (digest aaaaaaaaaaaa != bbbbbbbbbbbb)" in text

    # the same code: reused, nothing counted as retrained
    journal.put(key_n, {"run_id": "new", "acc": 0.5, "eval_k": 8, "code_digest": new_code}, config_key=cfg_n)
    reopened = AblationJournal.open(path, resume=True)
    assert reopened.other_code(cfg_n, new_code) is None and announce_code_changes(reopened, new_code) == 1
    assert _reuse(reopened, key_n, cfg_n, new_code)["run_id"] == "new"
    assert reopened.reused == 1 and reopened.retrained_for_code == 0
    assert _reuse(reopened, key_o, cfg_o, old_code)["run_id"] == "old"  # the old code would still reuse its own run


def test_the_committed_journals_stay_readable_and_name_their_code():
    """Every committed journal is read. Under other code every run is trained again: records from before code
    digests carry none ('none'), and the Table-1 rerun's 24 tuned runs carry the digest its report names."""
    import json
    from pathlib import Path

    results = Path(__file__).resolve().parents[1] / "benchmarks/results"
    for path in sorted(results.glob("*.journal.jsonl")):
        journal = AblationJournal.open(path, resume=True)
        runs = journal.runs_by_other_code("0" * 64)
        assert sum(runs.values()) >= 1, path.name
        if path.name != "ablation.journal.jsonl":
            assert set(runs) == {"none"}, path.name  # these predate code digests: all trained again
    report = json.loads((results / "ablation.json").read_text())
    table1 = AblationJournal.open(results / "ablation.journal.jsonl", resume=True)
    assert table1.runs_by_other_code("0" * 64)[report["code_digest"]] == 24  # 8 rungs x 3 seeds, tuned
    assert report["code_digest"] not in table1.runs_by_other_code(report["code_digest"])  # same code: reused


def test_git_tags_say_dirty_for_an_untracked_file_and_unknown_outside_git(tmp_path):
    import subprocess

    from tasks.tracking import git_tags

    assert git_tags(tmp_path) == {"git.sha": "unknown", "git.dirty": "unknown"}
    repo = tmp_path / "repo"
    repo.mkdir()
    env = ["-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / ".gitignore").write_text("ignored.txt\n")
    (repo / "a.py").write_text("x = 1\n")
    subprocess.run(["git", *env, "-C", str(repo), "add", "."], check=True)
    subprocess.run(["git", *env, "-C", str(repo), "commit", "-q", "-m", "init"], check=True)
    clean = git_tags(repo)
    assert len(clean["git.sha"]) == 40 and clean["git.dirty"] == "false"
    (repo / "ignored.txt").write_text("scratch")
    assert git_tags(repo)["git.dirty"] == "false"  # ignored files do not count
    (repo / "new_module.py").write_text("y = 2\n")
    assert git_tags(repo)["git.dirty"] == "true"  # an untracked, not ignored file does
    (repo / "new_module.py").unlink()
    (repo / "a.py").write_text("x = 2\n")
    assert git_tags(repo)["git.dirty"] == "true"
