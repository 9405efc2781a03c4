"""`dapo ablation`: the ladder (cumulative, one technique per rung, ending at the recipe), the report writer on
synthetic results, and one quick end-to-end run through the CLI with a tiny model (Prefect harness, MLflow SQLite)."""

from __future__ import annotations

import itertools
import json
import statistics
from pathlib import Path

import pytest

from dapo_core.config import load_config
from dapo_core.config.ablation import (
    AGGRESSIVE_LR_FACTOR,
    ALL_RUNGS,
    EVIDENCE_KEYS,
    KNOWN_RUNGS,
    LADDER_KEYS,
    PAPER_AIME,
    RUNG_NAMES,
    SFT_CONTROL,
    SFT_CONTROL_CLEAN,
    STOP_KEYS,
    SUCCESSOR_RUNGS,
    build_ladder,
    build_regimes,
    curve_test_freq,
    parse_regimes,
    parse_rungs,
    recipe_settings,
    run_overrides,
)
from dapo_core.engines.executor import loss_config_from
from dapo_core.evaluation.ablation_journal import code_digest
from dapo_core.evaluation.ablation_report import (
    check_results,
    paired_difference,
    render_markdown,
    summarize_rung,
    write_report,
)
from dapo_core.warmstart.control import control_lr
from flows.ablation import DEFAULT_RECIPE  # the ladder's recipe when `dapo ablation` gets no --recipe
from flows.base_model import warm_start_settings
from tasks.tracking import flatten_config, git_tags

ROOT = Path(__file__).resolve().parents[1]

DAPO_RECIPES = ("tiny-dapo", "tiny-dapo-table1", "dapo-qwen2.5-32b")


# ------------------------------------------------------------------------------------------------ the ladder
@pytest.mark.parametrize("recipe", DAPO_RECIPES)
def test_each_rung_adds_exactly_its_technique(recipe):
    ladder = build_ladder(load_config(recipe=recipe, env={}))
    assert [r.name for r in ladder] == list(RUNG_NAMES)
    for prev, rung in itertools.pairwise(ladder):
        changed = {k for k in LADDER_KEYS if prev.settings[k] != rung.settings[k]}
        assert changed == set(rung.keys), rung.name
        assert set(rung.overrides()) - set(prev.overrides()) == {f"{k}={_yaml(rung.settings[k])}" for k in changed}


@pytest.mark.parametrize("recipe", DAPO_RECIPES)
def test_the_ladder_is_cumulative(recipe):
    """A technique, once added, stays until a later rung's technique turns the same key (soft-overlong turns
    filtering back to the recipe's value)."""
    ladder = build_ladder(load_config(recipe=recipe, env={}))
    for j, added in enumerate(ladder):
        for i in range(j + 1, len(ladder)):
            later_keys = {k for r in ladder[j + 1 : i + 1] for k in r.keys}
            for key in set(added.keys) - later_keys:
                assert ladder[i].settings[key] == added.settings[key], (added.name, ladder[i].name, key)


@pytest.mark.parametrize("recipe", DAPO_RECIPES)
def test_the_last_rung_is_the_recipe_and_the_first_is_grpo(recipe):
    cfg = load_config(recipe=recipe, env={})
    ladder = build_ladder(cfg)
    dapo = load_config(recipe=recipe, overrides=ladder[-1].overrides(), env={})
    assert dapo.algorithm == cfg.algorithm  # every algorithm key, not only the ladder's
    assert dapo.data == cfg.data
    grpo = load_config(recipe=recipe, overrides=ladder[0].overrides(), env={})
    assert grpo.algorithm.clip_high == grpo.algorithm.clip_low
    assert grpo.algorithm.loss_agg == "seq-mean-token-mean"
    assert not grpo.algorithm.dynamic_sampling.enable and grpo.data.gen_batch_size == grpo.data.train_batch_size
    assert not grpo.algorithm.overlong.shaping and not grpo.algorithm.overlong.filtering
    for rung in ladder:  # every rung is a valid config of its own
        assert recipe_settings(load_config(recipe=recipe, overrides=rung.overrides(), env={})) == rung.settings


def test_tiny_grpo_recipe_is_the_first_rung_of_tiny_dapo():
    grpo = load_config(
        recipe="tiny-dapo", overrides=build_ladder(load_config(recipe="tiny-dapo", env={}))[0].overrides(), env={}
    )
    assert grpo.algorithm == load_config(recipe="tiny-grpo", env={}).algorithm


def test_the_ladders_default_recipe_is_tiny_dapo_at_a_doubled_batch():
    """`dapo ablation`'s default: tiny-dapo with 64 groups (96 generated), mini-batches of 32 (still 2 updates per
    rollout step) and its own output directory; every other key, the base model's included, is tiny-dapo's."""
    table1, tiny = load_config(recipe=DEFAULT_RECIPE, env={}), load_config(recipe="tiny-dapo", env={})
    d, t = table1.data, table1.trainer
    assert (d.train_batch_size, d.gen_batch_size, t.ppo_mini_batch_size) == (64, 96, 32)
    assert d.train_batch_size // t.ppo_mini_batch_size == tiny.data.train_batch_size // tiny.trainer.ppo_mini_batch_size
    assert d.gen_batch_size / d.train_batch_size == tiny.data.gen_batch_size / tiny.data.train_batch_size
    assert t.output_dir != tiny.trainer.output_dir and table1.tracking.run_name != tiny.tracking.run_name
    same = load_config(
        recipe="tiny-dapo",
        overrides=[
            "data.train_batch_size=64", "data.gen_batch_size=96", "trainer.ppo_mini_batch_size=32",
            f"trainer.output_dir={t.output_dir}", f"tracking.run_name={table1.tracking.run_name}",
        ],
        env={},
    )  # fmt: skip
    assert same.model_dump(exclude={"recipe"}) == table1.model_dump(exclude={"recipe"})


def test_a_recipe_without_dapos_techniques_is_a_clear_error():
    with pytest.raises(ValueError, match=r"clip_high \(0.2\) must be > algorithm.clip_low") as err:
        build_ladder(load_config(recipe="tiny-grpo", env={}))
    assert "dynamic_sampling.enable" in str(err.value) and "--recipe tiny-dapo" in str(err.value)


def test_successor_rungs_change_only_the_objective():
    cfg = load_config(recipe="tiny-dapo", env={})
    names = ["grpo", "dapo", *SUCCESSOR_RUNGS]
    rungs = {r.name: r for r in build_ladder(cfg, [*names, SFT_CONTROL])}
    assert list(rungs) == names  # the requested order; sft-control is not a training rung
    objective = {"algorithm.policy_loss", "algorithm.loss_agg", "algorithm.norm_adv_by_std"}
    for succ, base in (("gspo", "dapo"), ("cispo", "dapo"), ("gmpo", "dapo"), ("dr-grpo", "grpo")):
        changed = {k for k in LADDER_KEYS if rungs[succ].settings[k] != rungs[base].settings[k]}
        assert changed and changed <= objective, (succ, changed)
    want = {
        "gspo": ("gspo", (3e-4, 4e-4), "seq-mean-token-mean"),
        "cispo": ("cispo", (None, 5.0), "token-mean"),
        "gmpo": ("gmpo", (0.4, 0.4), "seq-mean-token-mean"),
        "dr-grpo": ("ppo-clip", (0.2, 0.2), "seq-mean-token-sum-norm"),
        "dapo": ("ppo-clip", (0.2, 0.28), "token-mean"),
    }
    for name, (mode, bounds, agg) in want.items():
        run = load_config(recipe="tiny-dapo", overrides=rungs[name].overrides(), env={})
        loss = loss_config_from(run)
        assert (loss.mode, (loss.clip_low, loss.clip_high), loss.loss_agg) == (mode, bounds, agg), name
        assert run.algorithm.norm_adv_by_std is (name != "dr-grpo")
    # the shipped recipes and the rungs agree on the objective
    for name in ("gspo", "cispo", "gmpo"):
        run = load_config(recipe="tiny-dapo", overrides=rungs[name].overrides(), env={})
        assert run.algorithm == load_config(recipe=f"tiny-{name}", env={}).algorithm
    drgrpo = load_config(recipe="tiny-dapo", overrides=rungs["dr-grpo"].overrides(), env={})
    assert drgrpo.algorithm == load_config(recipe="tiny-drgrpo", env={}).algorithm
    assert rungs["gspo"].paper_aime is None and rungs["dapo"].paper_aime == 50.0


def test_parse_rungs_keeps_order_and_refuses_bad_plans():
    assert parse_rungs(" dapo, gspo ,dapo,sft-control") == ["dapo", "gspo", "sft-control"]
    assert set(KNOWN_RUNGS) == {*RUNG_NAMES, *SUCCESSOR_RUNGS, SFT_CONTROL, SFT_CONTROL_CLEAN}
    with pytest.raises(ValueError, match=r"unknown rung\(s\) \['gpso'\]; valid: grpo"):
        parse_rungs("dapo,gpso")
    for control in ("sft-control", "sft-control-clean"):
        with pytest.raises(ValueError, match=f"{control} spend.*needs dapo among the rungs"):
            parse_rungs(f"grpo,{control}")
    with pytest.raises(ValueError, match="none given"):
        parse_rungs(" , ")
    with pytest.raises(ValueError, match=r"policy_loss \(gspo\) must be ppo-clip.*--rungs grpo,...,dapo,gspo"):
        build_ladder(load_config(recipe="tiny-gspo", env={}))


def test_regimes_lrs_and_run_overrides():
    cfg = load_config(recipe="tiny-dapo", env={})
    tuned, aggressive = build_regimes(cfg, "tuned,aggressive")
    assert tuned.lr == cfg.trainer.lr and aggressive.lr == pytest.approx(AGGRESSIVE_LR_FACTOR * cfg.trainer.lr)
    assert [r.lr for r in build_regimes(cfg, ["aggressive"], aggressive_lr=3e-3)] == [3e-3]
    assert parse_regimes(" aggressive , tuned,tuned") == ["aggressive", "tuned"]
    with pytest.raises(ValueError, match="valid: tuned, aggressive"):
        parse_regimes("tuned,bogus")
    with pytest.raises(ValueError, match="--tuned-lr"):
        build_regimes(cfg, "tuned", tuned_lr=0.0)
    assert [curve_test_freq(n) for n in (1, 2, 7, 8, 24)] == [1, 1, 7, 4, 12]
    with pytest.raises(ValueError, match="--steps"):
        curve_test_freq(0)
    sets = run_overrides(
        ["trainer.lr=9", "trainer.save_freq=3"], build_ladder(cfg)[2], aggressive, 3, 24, model_path="m"
    )
    run = load_config(recipe="tiny-dapo", overrides=sets, env={})
    assert run.trainer.lr == aggressive.lr and run.trainer.seed == 3 and run.trainer.total_steps == 24
    assert run.tracking.run_name == "ablation-aggressive-clip-higher-s3" and run.model.path == "m"
    assert run.trainer.test_freq == 12 and not run.trainer.val_before_train  # step 0: the shared base eval
    assert run.trainer.save_freq == 3  # the user's come first: the ablation's own keys (lr) win


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--regimes", "tuned,bogus"], "valid: tuned, aggressive"),
        (["--recipe", "tiny-grpo"], "must be a DAPO recipe"),
        (["--steps", "0"], "must be >= 1"),
        (["--seeds", "0"], "--seeds (0) must be >= 1"),
        (["--eval-k", "0"], "--eval-k (0) must be an integer >= 1"),
        (["--aggressive-lr", "-1"], "--aggressive-lr (-1.0) must be a learning rate > 0"),
        (["--rungs", "dapo,gpso"], "unknown rung(s) ['gpso']"),
        (["--rungs", "gspo,sft-control"], "needs dapo among the rungs"),
        (["--name", "../x"], "must be a plain name"),
    ],
)
def test_cli_rejects_a_bad_plan_before_any_work(args, message):
    from typer.testing import CliRunner

    from flows.cli import app

    result = CliRunner().invoke(app, ["ablation", *args])
    assert result.exit_code == 2 and message in " ".join(result.output.split()), result.output


def _yaml(value):
    return value if isinstance(value, str) else json.dumps(value)


# ------------------------------------------------------------------------------------------------ the report
GRPO_ACC = {1: 0.30, 2: 0.35, 3: 0.45}
DAPO_ACC = {1: 0.50, 2: 0.60, 3: 0.70}


def _records(name: str, offset: float) -> list[dict]:
    out = []
    for seed in (1, 2, 3):
        acc = {"grpo": GRPO_ACC, "dapo": DAPO_ACC}.get(name, {s: 0.4 + offset for s in (1, 2, 3)})[seed]
        rec = {"seed": seed, "acc": acc, "wall_s": 10.0 + seed, "run_id": f"{name}{seed}"}
        if name != SFT_CONTROL:
            rec["curve"] = [[0, 0.2], [4, 0.2 + offset], [8, acc]]
            rec.update({k: 0.1 * (1 + KNOWN_RUNGS.index(name)) for k in EVIDENCE_KEYS})
            rec["response_length/clip_ratio"] = 0.2 if name == "grpo" else 0.0
        out.append(rec)
    return out


def synthetic_results(seeds: int = 3) -> dict:
    regimes = {}
    for regime, lr, shift in (("tuned", 1e-4, 0.0), ("aggressive", 1e-3, -0.1)):
        rungs = []
        for i, name in enumerate(ALL_RUNGS):
            records = [dict(r, acc=r["acc"] + shift) for r in _records(name, 0.01 * i)][:seeds]
            rungs.append(summarize_rung(name, records))
        regimes[regime] = {"lr": lr, "rungs": rungs}
    return {"regimes": regimes, "base_acc": 0.19, "k": 8, "steps": 8, "recipe": "tiny-dapo"}


def test_report_files_schema_and_the_dapo_minus_grpo_line(tmp_path):
    results = synthetic_results()
    paths = write_report(results, tmp_path / "out")
    data = json.loads(paths.json.read_text())
    assert set(data["regimes"]) == {"tuned", "aggressive"}
    for regime in data["regimes"].values():
        assert [r["name"] for r in regime["rungs"]] == list(ALL_RUNGS)
        for r in regime["rungs"]:
            assert {"name", "mean", "std", "seeds", "wall_s", *EVIDENCE_KEYS} <= set(r)
            assert len(r["seeds"]) == 3 and r["wall_s"] == pytest.approx(12.0)
    grpo = data["regimes"]["tuned"]["rungs"][0]
    assert grpo["mean"] == pytest.approx(statistics.mean(GRPO_ACC.values()))
    assert grpo["std"] == pytest.approx(statistics.stdev(GRPO_ACC.values()))
    assert grpo["run_id"] == ["grpo1", "grpo2", "grpo3"]

    md = paths.md.read_text()
    for name in ALL_RUNGS:
        assert f"| {name} |" in md
    for name, aime in PAPER_AIME.items():
        assert f"| {name} | {aime:.0f} |" in md
    diffs = [DAPO_ACC[s] - GRPO_ACC[s] for s in (1, 2, 3)]  # +0.20, +0.25, +0.25
    mean, std = statistics.mean(diffs), statistics.stdev(diffs)
    line = next(x for x in md.splitlines() if x.startswith("- **DAPO − GRPO**"))
    assert f"{mean:+.3f} held-out avg@8 (" in line and f"mean − 2·std = {mean - 2 * std:+.3f} > 0" in line
    assert "- **DAPO − sft-control" in md
    # final scores at one k, curves at the runs' own validation k: each named where it is used
    md32 = render_markdown({**results, "k": 32, "curve_k": 8})
    assert "Held-out avg@32 on problems" in md32 and "held-out avg@32 (per seed" in md32
    assert "validation on the same problems (avg@8, mean over seeds)" in md32 and "evaluator (avg@32)" in md32
    assert "truncation at max_response_length (response_length/clip_ratio): grpo 20.0%" in md
    assert "TODO" not in md and "{" not in md
    assert paths.png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and paths.png.stat().st_size > 10_000


def test_a_successors_report_names_its_files_and_compares_each_with_its_base(tmp_path):
    rungs = [summarize_rung(n, _records(n, 0.02 * i)) for i, n in enumerate(["grpo", "dapo", *SUCCESSOR_RUNGS])]
    results = {"regimes": {"tuned": {"lr": 1e-4, "rungs": rungs}}, "base_acc": 0.19, "k": 8, "steps": 8}
    paths = write_report(results, tmp_path, name="successors")
    assert {p.name for p in tmp_path.iterdir()} == {"successors.json", "successors.md", "successors.png"}
    md = paths.md.read_text()
    assert md.startswith("# DAPO and its successors") and "Curves (successors.png)" in md
    # gspo's per-seed accuracy is 0.4 + 0.04 against DAPO_ACC: -0.06, -0.16, -0.26
    line = next(x for x in md.splitlines() if x.startswith("- **gspo − dapo (same seeds)**"))
    assert "-0.160 held-out" in line and "per seed -0.060, -0.160, -0.260" in line
    assert "- **dr-grpo − grpo (same seeds)**" in md and "- **cispo − dapo" in md and "- **gmpo − dapo" in md
    assert "| gspo | – |" in md  # not in Table 1: no paper number
    with pytest.raises(ValueError, match="must be a plain name"):
        write_report(results, tmp_path, name="a/b")


def _with_code(results: dict, shas: list[str], dirty: list) -> dict:
    """``results`` with one git_sha / git_dirty / code_digest per seed in every rung (as summarize_rung lists them)."""
    for regime in results["regimes"].values():
        for r in regime["rungs"]:
            r["git_sha"] = shas[: len(r["seeds"])]
            r["git_dirty"] = dirty[: len(r["seeds"])]
            r["code_digest"] = [f"{sha[0]}" * 64 for sha in shas[: len(r["seeds"])]]
    return results


def test_every_results_file_names_its_commits_and_whether_the_tree_was_dirty(tmp_path):
    """Top-level commits (sorted unique shas of the records) and dirty (any dirty record: true; any record that
    does not say: unknown; else false) in the JSON, stated in one line of the markdown."""
    sha_a, sha_b = "a" * 40, "b" * 40
    mixed = write_report(_with_code(synthetic_results(), [sha_b, sha_a, sha_b], [False, True, False]), tmp_path / "m")
    data = json.loads(mixed.json.read_text())
    assert data["commits"] == [sha_a, sha_b] and data["dirty"] is True
    assert data["code_digests"] == ["a" * 64, "b" * 64]
    line = next(x for x in mixed.md.read_text().splitlines() if x.startswith("Code: "))
    assert (
        line
        == f"Code: 2 commits ({'a' * 12}, {'b' * 12}: a mix) (dirty tree: uncommitted changes); code digest "
        + (f"{'a' * 12}, {'b' * 12}.")
    )
    clean = write_report(_with_code(synthetic_results(), [sha_a] * 3, [False] * 3), tmp_path / "c")
    data = json.loads(clean.json.read_text())
    assert data["commits"] == [sha_a] and data["dirty"] is False
    assert f"Code: commit {'a' * 12} (clean tree); code digest {'a' * 12}." in clean.md.read_text()
    # records from before the dirty flag (the committed journals): the flag is unknown, never assumed clean
    old = synthetic_results()
    for regime in old["regimes"].values():
        for r in regime["rungs"]:
            r["git_sha"] = [sha_a] * len(r["seeds"])
    legacy = write_report(old, tmp_path / "l")
    data = json.loads(legacy.json.read_text())
    assert data["commits"] == [sha_a] and data["dirty"] == "unknown" and data["code_digests"] == ["unknown"]
    assert f"Code: commit {'a' * 12} (tree dirty: unknown); code digest unknown." in legacy.md.read_text()
    partly = _with_code(synthetic_results(), [sha_a] * 3, [False, "unknown", False])
    assert json.loads(write_report(partly, tmp_path / "p").json.read_text())["dirty"] == "unknown"


def test_gspo_clip_share_is_named_a_share_of_tokens_and_a_cispo_clip_that_never_bound_is_said(tmp_path):
    rungs = [summarize_rung(n, _records(n, 0.02 * i)) for i, n in enumerate(["grpo", "dapo", *SUCCESSOR_RUNGS])]
    by_name = {r["name"]: r for r in rungs}
    by_name["cispo"]["actor/pg_clipfrac_high"] = by_name["cispo"]["actor/pg_clipfrac_low"] = 0.0
    md = render_markdown({"regimes": {"tuned": {"lr": 1e-4, "rungs": rungs}}, "k": 8})
    gspo = next(x for x in md.splitlines() if ": gspo clipped " in x)
    assert "of its tokens (the tokens of sequences whose sequence ratio was clipped)" in gspo
    assert "sequence ratios," not in gspo
    row = next(x for x in md.splitlines() if x.startswith("| cispo |"))
    assert row.count("0 (never bound)") == 2
    assert "cispo's weight clip (r ≤ 1 + eps_high) never bound" in md and "ppo_epochs > 1" in md
    gmpo = next(x for x in md.splitlines() if x.startswith("| gmpo |"))
    assert "never bound" not in gmpo  # a clip that acted, however rarely, is a percentage


def test_paired_difference_and_one_seed():
    results = synthetic_results(seeds=1)
    rungs = {r["name"]: r for r in results["regimes"]["tuned"]["rungs"]}
    d = paired_difference(rungs["dapo"], rungs["grpo"])
    assert d.diffs == [pytest.approx(0.2)] and d.std is None and d.lower is None
    assert rungs["grpo"]["std"] is None
    md = render_markdown(results)
    assert "one seed: no spread to judge seed noise by" in md and "± –" in md


def test_bad_results_are_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="non-empty 'regimes'"):
        write_report({}, tmp_path)
    with pytest.raises(ValueError, match=r"rung #0 \(grpo\) lacks \['std'"):
        check_results({"regimes": {"tuned": {"lr": 1.0, "rungs": [{"name": "grpo", "mean": 0.1}]}}})
    with pytest.raises(ValueError, match="no seed results"):
        summarize_rung("grpo", [])


# ------------------------------------------------------------------------------------------------ end to end
TINY = [
    "curation.synthetic.n=400",
    "curation.val_size=8",
    "base_model.steps=4",
    "base_model.batch_size=8",
    "base_model.micro_batch_size=8",
    "base_model.heldout_size=6",
    "base_model.heldout_k=2",
    "base_model.warmup_steps=0",
    "model.tiny.hidden_size=32",
    "model.tiny.num_hidden_layers=1",
    "model.tiny.intermediate_size=64",
    "trainer.save_freq=0",
    "data.train_batch_size=4",
    "data.gen_batch_size=6",
    "trainer.ppo_mini_batch_size=2",
    "rollout.n=4",
    "rollout.val_n=2",
    "data.max_response_length=16",
    "algorithm.overlong.buffer_length=4",
    "algorithm.dynamic_sampling.max_num_gen_batches=2",
    "algorithm.dynamic_sampling.on_exhausted=continue",
    "tracking.log_system_metrics=false",
    "algorithm.reward_fn=test_even_length",  # a reward with variance: a 4-step warm start solves nothing yet
]


def run_quick_ablation(tmp_path, monkeypatch, options: list[str]) -> None:
    """``dapo ablation --quick OPTIONS`` on the TINY settings in ``tmp_path`` (own MLflow store; the caller asks
    for the session's Prefect test server, ``prefect_api``)."""
    from typer.testing import CliRunner

    from flows.cli import app

    monkeypatch.chdir(tmp_path)  # curate/base model/train write data/ and outputs/ relative to the project
    store = [f"tracking.uri=sqlite:///{tmp_path}/mlflow.db", f"tracking.artifact_location={tmp_path}/a"]
    args = ["ablation", "--quick", *options]
    for item in [*TINY, *store]:
        args += ["--set", item]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output + repr(result.exception)


@pytest.mark.slow
def test_quick_ablation_through_the_cli(tmp_path, monkeypatch, prefect_api):
    import train_fixtures  # noqa: F401  (registers the test rewards)
    from mlflow.tracking import MlflowClient

    run_quick_ablation(tmp_path, monkeypatch, ["--recipe", "tiny-dapo"])

    out = tmp_path / "outputs/ablation-quick"
    assert {p.name for p in out.iterdir()} >= {"ablation.json", "ablation.md", "ablation.png"}
    data = json.loads((out / "ablation.json").read_text())
    assert set(data["regimes"]) == {"tuned", "aggressive"} and data["steps"] == 2
    assert data["regimes"]["aggressive"]["lr"] == pytest.approx(AGGRESSIVE_LR_FACTOR * data["regimes"]["tuned"]["lr"])
    quick_cfg = load_config(recipe="tiny-dapo", overrides=TINY, env={})
    code = code_digest()
    git = git_tags(ROOT)
    assert data["code_digest"] == code and data["code_digests"] == [code] and data["retrained_for_code"] == 0
    assert data["commits"] == [git["git.sha"]] and data["dirty"] == {"true": True, "false": False}[git["git.dirty"]]
    for regime in data["regimes"].values():
        assert [r["name"] for r in regime["rungs"]] == list(ALL_RUNGS)
        for r in regime["rungs"]:
            assert r["seed_ids"] == [1] and r["mean"] == r["seeds"][0]
            assert r["code_digest"] == [code] and r["git_sha"] == [git["git.sha"]]
        rungs = {r["name"]: r for r in regime["rungs"]}
        # dynamic sampling: off below the dapo rung (every group kept), on at dapo (logged; <= 1 by construction)
        for name in RUNG_NAMES[:-1]:
            assert rungs[name]["train/kept_groups_frac"] in (None, 1.0), name
        for name in RUNG_NAMES:  # the clip fractions were logged, as fractions
            assert all(0.0 <= rungs[name][key] <= 1.0 for key in ("actor/pg_clipfrac_high", "actor/pg_clipfrac_low"))
        for name in RUNG_NAMES:  # the base model's evaluation, then every step (test_freq 1 of 2 steps)
            assert [s for s, _ in rungs[name]["curve"]] == [0, 1, 2], name
            assert rungs[name]["curve"][0][1] == pytest.approx(data["base_acc"])
        dapo = rungs["dapo"]
        # each control's budget: the dapo run's training CPU seconds (local executor), spent on >= 1 SFT step, at
        # its own lr (the clean one at control.clean_lr, the other where the warm start's schedule ended)
        assert dapo["train_cpu_s"][0] > 0
        for name in (SFT_CONTROL, SFT_CONTROL_CLEAN):
            control = rungs[name]
            assert control["budget_kind"] == ["cpu"] and control["curve"] == [], name
            assert control["budget_s"][0] == pytest.approx(dapo["train_cpu_s"][0])
            assert control["cpu_s"][0] >= control["budget_s"][0] and control["sft_steps"][0] >= 1
        assert rungs[SFT_CONTROL]["sft_lr"] == [pytest.approx(control_lr(warm_start_settings(quick_cfg)))]
        assert rungs[SFT_CONTROL_CLEAN]["sft_lr"] == [pytest.approx(quick_cfg.control.clean_lr)]

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    parent = client.get_run(data["parent_run_id"])
    exp = parent.info.experiment_id
    roots = [r for r in client.search_runs([exp]) if "mlflow.parentRunId" not in r.data.tags]
    assert [r.info.run_id for r in roots] == [parent.info.run_id]  # one parent run
    children = client.search_runs([exp], filter_string=f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    assert all(r.info.status == "FINISHED" for r in children)
    trained = {
        (r.data.tags["ablation.regime"], r.data.tags["ablation.rung"], r.data.tags["ablation.seed"])
        for r in children
        if r.data.tags.get("ablation.kind") in ("train", "control")
    }
    assert trained == {(g, n, "1") for g in ("tuned", "aggressive") for n in ALL_RUNGS}
    evals = [r for r in children if r.data.tags.get("ablation.kind") == "eval"]
    assert len(evals) == 2 * len(ALL_RUNGS)
    runs = {r.info.run_name: r for r in children}
    assert runs["ablation-tuned-grpo-s1"].data.params["algorithm.loss_agg"] == "seq-mean-token-mean"
    assert runs["ablation-aggressive-dapo-s1"].data.params["data.gen_batch_size"] == "6"
    # each rung trained as configured: its ladder keys in the run's params, as the rung's own config resolves them
    cfg = load_config(recipe="tiny-dapo", overrides=TINY, env={})
    for rung in build_ladder(cfg):
        want = flatten_config(load_config(recipe="tiny-dapo", overrides=[*TINY, *rung.overrides()], env={}))
        for regime in ("tuned", "aggressive"):
            params = runs[f"ablation-{regime}-{rung.name}-s1"].data.params
            assert {k: params[k] for k in LADDER_KEYS} == {k: want[k] for k in LADDER_KEYS}, (regime, rung.name)
    # the dapo rung's kept fraction is the mean over its steps of 1 - the zero-variance share its run logged
    for regime, reg in data["regimes"].items():
        dapo_rung = next(r for r in reg["rungs"] if r["name"] == "dapo")
        hist = client.get_metric_history(runs[f"ablation-{regime}-dapo-s1"].info.run_id, "train/zero_std_groups_frac")
        assert len(hist) == data["steps"], regime
        want = sum(1.0 - m.value for m in hist) / len(hist)
        assert dapo_rung["train/kept_groups_frac"] == pytest.approx(want), regime
    clip = {n: runs[f"ablation-tuned-{n}-s1"].data.params["algorithm.clip_high"] for n in RUNG_NAMES}
    assert clip["grpo"] == clip["overlong-filtering"] == "0.2" and clip["clip-higher"] == clip["dapo"] == "0.28"
    # each rung's score is its own final model's evaluation: the eval run's logged avg@k
    for regime in data["regimes"].values():
        for r in regime["rungs"]:
            ev = client.get_run(r["eval_run_id"][0])
            at_k = [key for key in ev.data.metrics if key.endswith(f"acc/mean_at_{data['k']}")]
            assert at_k and ev.data.metrics[at_k[0]] == pytest.approx(r["seeds"][0]), r["name"]
            # the row's stop split is its final model's: the eval run's logged val/<ds>/stop/* (one data source)
            for key in STOP_KEYS:
                logged = [v for m, v in ev.data.metrics.items() if m.endswith("/" + key)]
                if r[key] is None:  # acc if stops: no response of the run stopped at its answer line
                    assert key == "stop/acc_when_stopped" and r["stop/stopped_rate"] == 0.0, r["name"]
                else:
                    assert logged == [pytest.approx(r[key])], (r["name"], key)
    assert {a.path for a in client.list_artifacts(parent.info.run_id, "ablation")} == {
        "ablation/ablation.json",
        "ablation/ablation.md",
        "ablation/ablation.png",
    }


@pytest.mark.slow
def test_quick_successors_run_writes_its_own_report(tmp_path, monkeypatch, prefect_api):
    """DAPO's successors beside the ladder (issue 17): each rung trains with its objective, one report named
    successors, the dr-grpo and gspo runs carrying their settings in MLflow."""
    import train_fixtures  # noqa: F401  (registers the test rewards)
    from mlflow.tracking import MlflowClient

    rungs = ["dapo", *SUCCESSOR_RUNGS]
    # an ablation cut short (here: planned without dr-grpo), then resumed with the whole plan
    run_quick_ablation(
        tmp_path, monkeypatch, ["--regimes", "tuned", "--rungs", ",".join(rungs[:-1]), "--name", "successors"]
    )
    out = tmp_path / "outputs/ablation-quick"
    first = json.loads((out / "successors.json").read_text())
    run_quick_ablation(
        tmp_path, monkeypatch,
        ["--regimes", "tuned", "--rungs", ",".join(rungs), "--name", "successors", "--resume"],
    )  # fmt: skip

    assert {p.name for p in out.iterdir()} == {
        "successors.json", "successors.md", "successors.png", "successors.journal.jsonl"
    }  # fmt: skip
    data = json.loads((out / "successors.json").read_text())
    # the resumed run reused the 4 journaled runs (same results, same parent run) and trained only dr-grpo
    assert first["reused_runs"] == 0 and data["reused_runs"] == len(rungs) - 1
    assert data["parent_run_id"] == first["parent_run_id"]
    for before, after in zip(first["regimes"]["tuned"]["rungs"], data["regimes"]["tuned"]["rungs"], strict=False):
        assert (before["name"], before["seeds"], before["run_id"]) == (after["name"], after["seeds"], after["run_id"])
    assert list(data["regimes"]) == ["tuned"]
    assert [r["name"] for r in data["regimes"]["tuned"]["rungs"]] == rungs
    for r in data["regimes"]["tuned"]["rungs"]:
        assert [s for s, _ in r["curve"]] == [0, 1, 2], r["name"]
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    parent = client.get_run(data["parent_run_id"])
    assert parent.info.run_name == f"successors-{DEFAULT_RECIPE}"
    assert parent.data.tags["ablation.rungs"] == ",".join(rungs)
    children = client.search_runs(
        [parent.info.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{parent.info.run_id}'"
    )
    names = [r.info.run_name for r in children if r.data.tags.get("ablation.kind") == "train"]
    assert sorted(names) == sorted(f"ablation-tuned-{n}-s1" for n in rungs)  # each run once, none repeated
    params = {r.info.run_name: r.data.params for r in children}
    assert params["ablation-tuned-gspo-s1"]["algorithm.policy_loss"] == "gspo"
    assert params["ablation-tuned-cispo-s1"]["algorithm.policy_loss"] == "cispo"
    assert params["ablation-tuned-gmpo-s1"]["algorithm.loss_agg"] == "seq-mean-token-mean"
    assert params["ablation-tuned-dr-grpo-s1"]["algorithm.norm_adv_by_std"] == "false"
    assert params["ablation-tuned-dapo-s1"]["algorithm.policy_loss"] == "ppo-clip"


@pytest.mark.slow
def test_a_resumed_ablation_scores_journaled_runs_at_a_new_k_without_training_them_again(
    tmp_path, monkeypatch, prefect_api
):
    """--eval-k on --resume: the journaled run's final model is evaluated at the new k (one eval run, journaled
    under the run), not trained again; a model on disk that is not the journaled run's any more is trained again;
    a record from before model digests were journaled is trusted only when its own score reproduces (and is then
    journaled with its digest)."""
    import train_fixtures  # noqa: F401  (registers the test rewards)
    from mlflow.tracking import MlflowClient

    out = tmp_path / "outputs/ablation-quick"
    journal = out / "rescore.journal.jsonl"
    plan = ["--regimes", "tuned", "--rungs", "grpo", "--name", "rescore"]

    def run(*extra: str) -> tuple[dict, dict]:
        run_quick_ablation(tmp_path, monkeypatch, [*plan, *extra])
        data = json.loads((out / "rescore.json").read_text())
        return data, data["regimes"]["tuned"]["rungs"][0]

    first, grpo1 = run()
    assert first["k"] == first["curve_k"] == 2  # --quick: the recipe's rollout.val_n
    assert grpo1["eval_k"] == [2] and len(grpo1["model_digest"][0]) == 64

    second, grpo2 = run("--resume", "--eval-k", "3")
    assert second["k"] == 3 and second["curve_k"] == 2 and second["reused_runs"] == 1
    assert grpo2["run_id"] == grpo1["run_id"] and grpo2["eval_k"] == [3]  # the same training run, scored again
    assert grpo2["eval_run_id"] != grpo1["eval_run_id"] and grpo2["curve"] == grpo1["curve"]
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    ev = client.get_run(grpo2["eval_run_id"][0])
    at3 = [key for key in ev.data.metrics if key.endswith("acc/mean_at_3")]
    assert at3 and ev.data.metrics[at3[0]] == pytest.approx(grpo2["seeds"][0])
    trains = [r for r in client.search_runs([ev.info.experiment_id]) if r.data.tags.get("ablation.kind") == "train"]
    assert len(trains) == 1

    # another run overwrote the final model: its digest no longer matches, so the run is trained again
    runs_dir = tmp_path / load_config(recipe=DEFAULT_RECIPE, env={}).trainer.output_dir  # the runs' trainer.output_dir
    weights = next((runs_dir / "ablation-tuned-grpo-s1" / "final").glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:-8] + b"\x00" * 8)
    third, grpo3 = run("--resume", "--eval-k", "4")
    assert third["k"] == 4 and third["reused_runs"] == 0 and grpo3["eval_k"] == [4]
    assert grpo3["run_id"] != grpo1["run_id"]
    # the journal's score at k=3 was the overwritten run's: the new run is evaluated at k=3 itself
    again, grpo3b = run("--resume", "--eval-k", "3")
    assert grpo3b["run_id"] == grpo3["run_id"] and grpo3b["eval_run_id"] != grpo2["eval_run_id"]
    assert again["reused_runs"] == 1

    # a record journaled before digests existed: trusted when its score reproduces at its own k (the model is intact)
    lines = [json.loads(line) for line in journal.read_text().splitlines()]
    for item in lines:
        item.get("record", {}).pop("model_digest", None)
        item.get("record", {}).pop("model_dir", None)
    journal.write_text("".join(json.dumps(item) + "\n" for item in lines))
    fourth, grpo4 = run("--resume", "--eval-k", "5")
    assert fourth["k"] == 5 and fourth["reused_runs"] == 1
    assert grpo4["run_id"] == grpo3["run_id"] and grpo4["eval_k"] == [5]
    checks = [r for r in client.search_runs([ev.info.experiment_id]) if r.info.run_name.endswith("-eval-check")]
    assert len(checks) == 1  # the reproduced score at k=4
    # ... and from then on journaled with its digest: the next k needs no reproduce check
    assert len(grpo4["model_digest"][0]) == 64
    fifth, grpo5 = run("--resume", "--eval-k", "6")
    assert fifth["reused_runs"] == 1 and grpo5["run_id"] == grpo3["run_id"] and grpo5["eval_k"] == [6]
    checks = [r for r in client.search_runs([ev.info.experiment_id]) if r.info.run_name.endswith("-eval-check")]
    assert len(checks) == 1
