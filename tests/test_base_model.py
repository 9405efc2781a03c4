"""The base-model warm start: data exclusion, SFT lowering the loss, a loadable HF directory whose tokenizer
round-trips the task text, determinism, and the cached Prefect flow with MLflow on SQLite (and its CLI)."""

from __future__ import annotations

import json

import pytest
import torch
import typer
from mlflow.tracking import MlflowClient
from typer.testing import CliRunner

from dapo_core.config import BaseModelStageConfig, ConfigError, DemosConfig, load_config
from dapo_core.data.schema import ProblemRecord, write_rl_parquet
from dapo_core.data.synthetic import generate_problems
from dapo_core.engines.models import load_model
from dapo_core.engines.tokenizer import load_tokenizer
from dapo_core.seeding import derive_seed
from dapo_core.warmstart.sft import (
    WarmStartConfig,
    evaluate_heldout,
    exclusion_digest,
    heldout_problems,
    normalize_question,
    prompt_ids,
    response_ids,
    run_warm_start,
    sft_batches,
)

SMALL_MODEL = [
    "model.tiny.hidden_size=32",
    "model.tiny.num_hidden_layers=2",
    "model.tiny.num_attention_heads=4",
    "model.tiny.num_key_value_heads=2",
    "model.tiny.intermediate_size=64",
    "model.tiny.max_position_embeddings=128",
]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models gain nothing from intra-op threads, and on a loaded box OpenMP spin-waits dominate."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def small_ws(**kw) -> WarmStartConfig:
    """The schema's warm start (every knob at its default) with a small budget, seed 3 and 24 new tokens."""
    base = dict(steps=12, lr=1e-2, warmup_steps=2, batch_size=16, micro_batch_size=16, heldout_size=4,
                heldout_k=2, log_every=3)  # fmt: skip
    return WarmStartConfig.from_config(BaseModelStageConfig(), seed=3, max_new_tokens=24, **{**base, **kw})


# ------------------------------------------------------------------------------------------------ data
def test_normalize_question_strips_template_and_spaces() -> None:
    assert normalize_question(" Q: 71 - 57*6\n") == "71-57*6"
    assert normalize_question("71-57*6") == "71-57*6"
    assert exclusion_digest(["Q: 1+2", "1+2", "3*4"]) == exclusion_digest(["3*4", "1 + 2"])


def test_sft_stream_never_yields_excluded_or_heldout_questions() -> None:
    # one-operation problems repeat often, so exclusion really has to filter
    first = [
        p.question
        for batch, _ in zip(sft_batches(50, DemosConfig(max_ops=1), seed=1), range(4), strict=False)
        for p in batch
    ]
    exclude = set(first[:100])
    held = heldout_problems(30, seed=1, exclude=[f"Q: {q}" for q in first[100:120]], min_ops=1, max_ops=1)
    assert not {p.question for p in held} & set(first[100:120])
    assert len({p.question for p in held}) == 30  # distinct
    banned = exclude | {p.question for p in held}
    seen = [
        p.question
        for batch, _ in zip(sft_batches(50, DemosConfig(max_ops=1), seed=1, exclude=banned), range(20), strict=False)
        for p in batch
    ]
    assert len(seen) == 1000 and not set(seen) & banned


def test_sft_stream_is_seeded() -> None:
    a = next(sft_batches(8, DemosConfig(), seed=5))
    assert a == next(sft_batches(8, DemosConfig(), seed=5))
    assert a != next(sft_batches(8, DemosConfig(), seed=6))


def test_prompt_and_response_ids_follow_the_chat_template(tmp_path) -> None:
    from dapo_core.engines.tokenizer import DEFAULT_ALPHABET, build_char_tokenizer

    tok = build_char_tokenizer(DEFAULT_ALPHABET)
    assert tok.decode(prompt_ids(tok, "71-57*6")) == "Q: 71-57*6<|im_end|><|im_start|>"
    ids = response_ids(tok, "57*6=342\n71-342=-271\nAnswer: -271")
    assert ids[-1] == tok.eos_token_id
    assert tok.decode(ids, skip_special_tokens=True) == "57*6=342\n71-342=-271\nAnswer: -271"


def test_settings_come_from_the_base_model_section() -> None:
    from flows.base_model import warm_start_settings

    cfg = load_config(recipe="tiny-dapo", overrides=["base_model.lr=0.005", "trainer.seed=7"])
    ws = warm_start_settings(cfg)
    assert (ws.lr, ws.seed, ws.max_new_tokens) == (0.005, 7, cfg.data.max_response_length)
    # every knob is the section's, nothing restated: the settings are the section plus the seed and the length
    assert ws.model_dump(exclude={"seed", "max_new_tokens"}) == cfg.base_model.model_dump()
    # the stage's knobs (None = the section's) and its own seed go on top
    given = warm_start_settings(cfg, steps=5, lr=None, heldout_k=3, seed=11)
    assert (given.steps, given.lr, given.heldout_k, given.seed) == (5, 0.005, 3, 11)


def test_every_setting_defaults_to_the_schema_and_nowhere_else() -> None:
    """The single source of the warm start's defaults: the base_model section. Built from a default section,
    every field equals the schema's default; the only fields the settings add (seed, max_new_tokens) have none."""
    import inspect

    ws = WarmStartConfig.from_config(BaseModelStageConfig(), seed=0, max_new_tokens=8)
    assert set(inspect.get_annotations(WarmStartConfig)) == {"seed", "max_new_tokens"}  # no knob declared again
    section_fields = BaseModelStageConfig.model_fields
    assert set(WarmStartConfig.model_fields) == {*section_fields, "seed", "max_new_tokens"}
    for name, field in section_fields.items():
        assert getattr(ws, name) == field.get_default(call_default_factory=True), name
    assert all(WarmStartConfig.model_fields[name].is_required() for name in ("seed", "max_new_tokens"))
    optim = ws.optim_config()  # the SFT optimizer: the section's schedule, AdamW's own betas
    assert (optim.lr, optim.weight_decay, optim.grad_clip, optim.warmup_steps, optim.min_lr_ratio) == (
        ws.lr, ws.weight_decay, ws.grad_clip, ws.warmup_steps, ws.min_lr_ratio,
    )  # fmt: skip
    assert (optim.scheduler, optim.total_steps, optim.betas) == ("cosine", ws.steps, None)
    with pytest.raises(ValueError, match="seed"):
        WarmStartConfig.model_validate(BaseModelStageConfig().model_dump())  # no seed, no length: no defaults


def test_the_stamp_is_the_one_base_models_were_built_under() -> None:
    """The stage's cache stamp of params.yaml's warm start, as it was before its settings were built from the
    section (issue 44): a base model built then is still up to date."""
    from flows.base_model import warm_start_settings

    stamp = warm_start_settings(load_config(recipe="tiny-dapo", env={})).stamp()
    assert stamp == {
        "batch_size": 56, "check_every": 100, "check_from": 0, "grad_clip": 1.0, "heldout_k": 8,
        "heldout_size": 200, "lr": 0.0015, "max_new_tokens": 80, "max_ops": 4, "micro_batch_size": 16,
        "min_lr_ratio": 0.1, "min_ops": 1, "num_demos": None, "probe_size": 200, "run_on_frac": 0.6,
        "run_on_style": "answer_only", "scarce_demos": 0, "scarce_from_ops": None, "seed": 42, "shortcut_frac": 0.0,
        "shortcut_style": "answer_only", "steps": 1200, "target_greedy_acc": None, "time_budget_s": None,
        "warmup_steps": 100, "weight_decay": 0.0,
    }  # fmt: skip


def test_bad_settings_say_key_value_and_rule() -> None:
    from flows.base_model import warm_start_settings

    cfg = load_config(recipe="tiny-dapo")
    with pytest.raises(ConfigError, match=r"^base_model.steps \(0\) must be > 0"):
        warm_start_settings(cfg, steps=0)
    with pytest.raises(ConfigError, match=r"^base_model.time_budget_s \(-1\) must be > 0"):
        small_ws(time_budget_s=-1)
    with pytest.raises(
        ConfigError, match=r"\(\+ --set base_model.time_budget_s=0\): base_model.time_budget_s \(0\) must be > 0"
    ):
        load_config(recipe="tiny-dapo", overrides=["base_model.time_budget_s=0"])
    with pytest.raises(ConfigError, match=r"^base_model.min_lr_ratio \(1.5\) must be in \[0, 1\]"):
        small_ws(min_lr_ratio=1.5)


# ------------------------------------------------------------------------------------------------ SFT
@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("sft") / "base_model"
    cfg = load_config(recipe="tiny-dapo", overrides=SMALL_MODEL)
    logged: list[tuple[int, dict]] = []
    result = run_warm_start(
        cfg, small_ws(), exclude=["Q: 1+2"], output_dir=out, on_metrics=lambda s, m: logged.append((s, m))
    )
    return cfg, result, logged


def test_sft_lowers_the_loss_and_reports_heldout_metrics(small_run) -> None:
    _, result, logged = small_run
    losses = [m["sft/loss"] for _, m in result.history]
    assert [s for s, _ in result.history] == [3, 6, 9, 12]
    assert losses[-1] < losses[0] - 0.5, losses  # from ~ln(80)=4.4 down
    assert result.steps == 12 and result.stopped_by == "steps"
    final = result.final_metrics
    first = result.history[0][1]
    assert final["sft/token_acc"] > 2 * first["sft/token_acc"], (first, final)  # measured 0.050 -> 0.157
    # 12 steps teach the format, not yet the arithmetic: every held-out answer is still wrong (measured), so a
    # scorer or an average that credits a wrong answer shows up as a non-zero here
    for key in ("heldout/acc/greedy", "heldout/acc/mean_at_2", "heldout/acc/pass_at_2"):
        assert final[key] == 0.0, (key, final[key])
    # the held-out metrics are those of the saved (trained) model on the documented held-out set: evaluating it
    # again gives the same numbers (measured: mean length 15.375, a quarter truncated; the untrained model differs)
    model, tok = load_model(str(result.output_dir)), load_tokenizer(str(result.output_dir))
    held = heldout_problems(4, seed=3, min_ops=1, max_ops=4, exclude=["Q: 1+2"])
    again = evaluate_heldout(model.eval(), tok, held, k=2, seed=derive_seed(3, "heldout_sampling"), max_new_tokens=24)
    assert again == {k: v for k, v in final.items() if k.startswith("heldout/") and k != "heldout/eval_s"}
    assert 1 <= final["heldout/response_length/mean"] <= 24
    assert logged[-1] == (12, final)  # the callback got the final metrics too
    assert result.num_excluded == 1 + 4  # the caller's exclusion + the held-out set


def test_saved_dir_loads_and_tokenizer_round_trips_task_text(small_run) -> None:
    _, result, _ = small_run
    model = load_model(str(result.output_dir))
    tok = load_tokenizer(str(result.output_dir))
    assert model.config.hidden_size == 32
    for p in generate_problems(50, seed=9):
        for text in (f"Q: {p.question}", p.solution):
            assert tok.decode(tok.encode(text)) == text
    ids = prompt_ids(tok, "3*4")  # the loaded tokenizer keeps the chat template
    assert tok.decode(ids) == "Q: 3*4<|im_end|><|im_start|>"


def test_same_seed_same_weights(small_run, tmp_path) -> None:
    cfg, result, _ = small_run
    again = run_warm_start(cfg, small_ws(), exclude=["1+2"], output_dir=tmp_path / "again")
    a = load_model(str(result.output_dir)).state_dict()
    b = load_model(str(again.output_dir)).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert again.final_metrics["heldout/acc/mean_at_2"] == result.final_metrics["heldout/acc/mean_at_2"]


def test_time_budget_stops_early_and_still_evaluates(small_run) -> None:
    cfg, _, _ = small_run
    result = run_warm_start(cfg, small_ws(time_budget_s=1e-6, heldout_size=2, heldout_k=1))
    assert result.steps == 1 and result.stopped_by == "time_budget"
    assert [s for s, _ in result.history] == [1]  # the partial window is still logged
    assert "heldout/acc/mean_at_1" in result.final_metrics and result.output_dir is None


def test_target_accuracy_stops_at_the_first_check_that_reaches_it(small_run, monkeypatch) -> None:
    import dapo_core.warmstart.sft as sft

    cfg, _, _ = small_run
    seen: list[tuple[int, int]] = []  # (probe size, call number)
    answers = iter([0.05, 0.2, 0.5, 0.9])

    def fake_greedy(model, tokenizer, problems, **kw):
        seen.append((len(problems), len(seen)))
        return next(answers)

    monkeypatch.setattr(sft, "greedy_accuracy", fake_greedy)
    logged: list[tuple[int, dict]] = []
    ws = small_ws(target_greedy_acc=0.4, check_every=2, check_from=4, probe_size=5, heldout_size=2, heldout_k=1)
    result = run_warm_start(cfg, ws, on_metrics=lambda s, m: logged.append((s, m)))
    # checks at steps 4, 6, 8: 0.05, 0.2, 0.5 >= 0.4 stops at 8 (the real greedy check of held-out is patched too)
    assert result.steps == 8 and result.stopped_by == "target"
    assert [s for s, m in logged[:-1] if "sft/probe_greedy_acc" in m] == [4, 6, 8]  # then the final metrics
    assert [n for n, _ in seen[:3]] == [5, 5, 5]
    assert result.final_metrics["sft/probe_greedy_acc"] == 0.5 and result.final_metrics["sft/steps"] == 8
    assert 8 in [s for s, m in result.history if "sft/loss" in m]  # the window before the stop is logged


def test_probe_set_is_disjoint_from_heldout_and_never_trained_on(monkeypatch) -> None:
    held = heldout_problems(40, seed=3, min_ops=1, max_ops=1)
    probe = heldout_problems(40, seed=3, min_ops=1, max_ops=1, exclude=[p.question for p in held], stream="probe")
    assert len(probe) == 40 and not {p.question for p in probe} & {p.question for p in held}
    assert [p.question for p in probe] != [p.question for p in held[:40]]


def test_target_setting_is_checked() -> None:
    with pytest.raises(ConfigError, match=r"base_model.target_greedy_acc \(1.5\) must be in \(0, 1\]"):
        small_ws(target_greedy_acc=1.5)


# ------------------------------------------------------------------------------------------------ flow
@pytest.fixture(scope="module")
def prefect_harness(prefect_api):
    """The session's Prefect test server for this module (tests/prefect_shared.py)."""
    return prefect_api


def write_curated(root) -> str:
    problems = generate_problems(6, seed=77)
    records = [
        ProblemRecord(data_source="synthetic", prompt=[{"role": "user", "content": f"Q: {p.question}"}],
                      ground_truth=str(p.answer), index=i, raw_problem=p.question)
        for i, p in enumerate(problems)
    ]  # fmt: skip
    return str(write_rl_parquet(records, root / "val.parquet"))


@pytest.mark.slow
def test_flow_logs_to_mlflow_and_is_cached(prefect_harness, tmp_path) -> None:
    from flows.base_model import base_model_flow
    from flows.cli.base_model import register

    val = write_curated(tmp_path)
    overrides = [
        *SMALL_MODEL,
        f"tracking.uri=sqlite:///{tmp_path}/mlflow.db",
        f"tracking.artifact_location={tmp_path}/mlartifacts",
        "tracking.log_system_metrics=false",
        "data.max_response_length=24",
        f"data.train_files=[{tmp_path}/missing.parquet]",
        f"data.val_files=[{val}]",
    ]
    out = str(tmp_path / "base_model")
    knobs = dict(steps=6, lr=0.01, batch_size=8, heldout_size=3, heldout_k=2)
    # first run: the knobs through the config's base_model: section
    first = base_model_flow(
        recipe="tiny-dapo", overrides=[*overrides, *(f"base_model.{k}={v}" for k, v in knobs.items())], output_dir=out
    )
    assert first["cached"] is False and first["steps"] == 6 and first["num_excluded"] == 6 + 3
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    run = client.get_run(first["run_id"])
    assert run.data.params["warm_start.steps"] == "6" and run.data.params["warm_start.seed"] == "42"
    assert run.data.tags["base_model.cached"] == "false"
    loss = [m.value for m in sorted(client.get_metric_history(first["run_id"], "sft/loss"), key=lambda m: m.step)]
    assert len(loss) == 1 + 1  # one log point (log_every=10 > 6 steps: the last step) + the final record
    assert "heldout/acc/mean_at_2" in run.data.metrics
    arts = {a.path for a in client.list_artifacts(first["run_id"], "model")}
    assert {"model/config.json", "model/model.safetensors", "model/tokenizer.json"} <= arts
    stamp = json.loads((tmp_path / "base_model" / "base_model_stamp.json").read_text())
    assert stamp["digest"] == first["digest"]

    # same settings as CLI flags: same stamp, so reused, not retrained; the held-out metrics are reported again
    app = typer.Typer()
    register(app)
    app.command("noop")(lambda: None)  # a second command keeps typer from collapsing the group
    sets = [arg for o in overrides for arg in ("--set", o)]
    cli_knobs = ["--steps", "6", "--lr", "0.01", "--batch-size", "8", "--heldout-size", "3", "--heldout-k", "2"]
    res = CliRunner().invoke(app, ["base-model", "--recipe", "tiny-dapo", *sets, "-o", out, *cli_knobs])
    assert res.exit_code == 0, res.output
    assert "reused (up to date)" in res.output and "heldout/acc/mean_at_2" in res.output
    runs = client.search_runs([run.info.experiment_id], order_by=["attributes.start_time DESC"])
    assert runs[0].data.tags["base_model.cached"] == "true"
    assert runs[0].data.metrics["heldout/acc/mean_at_2"] == run.data.metrics["heldout/acc/mean_at_2"]

    # a changed knob (or exclusion set) changes the stamp: rebuilt
    third = base_model_flow(recipe="tiny-dapo", overrides=overrides, output_dir=out, **{**knobs, "steps": 4})
    assert third["steps"] == 4
    assert third["cached"] is False and third["digest"] != first["digest"]


def test_cli_rejects_bad_knobs_cleanly(tmp_path) -> None:
    from flows.cli.base_model import register

    app = typer.Typer()
    register(app)
    app.command("noop")(lambda: None)
    res = CliRunner().invoke(app, ["base-model", "--recipe", "no-such-recipe"])
    assert res.exit_code == 2 and "no-such-recipe" in res.output
