"""One parameter surface per stage: `dapo <stage>` and the stage's Prefect deployment come from the same ``Param``
list (flows/stage_params.py), so an option is written once, and both reach the flow with the same arguments."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from typer.testing import CliRunner

from dapo_core.config import load_config
from flows import serve as S
from flows import stage_params as P
from flows import stages
from flows.cli import app

runner = CliRunner()


def _cli_options(stage: str) -> dict[str, Any]:
    """The Click options of `dapo <stage>`: parameter name -> click option."""
    import typer.main

    command = typer.main.get_command(app).commands[stage]  # type: ignore[attr-defined]
    return {p.name: p for p in command.params}


def _form(stage: str) -> dict[str, Any]:
    from prefect.utilities.callables import parameter_schema

    return parameter_schema(S.DEPLOYMENTS[stage]).model_dump_for_openapi()["properties"]


@pytest.mark.parametrize("stage", list(P.STAGES))
def test_the_cli_and_the_form_offer_the_same_parameters_with_the_same_help_and_defaults(stage):
    spec = P.STAGES[stage]
    options, form = _cli_options(stage), _form(stage)
    assert list(S.DEPLOYMENTS) == list(P.STAGES)
    assert set(options) - {"help"} == {p.name for p in spec.params}
    assert set(form) == {p.name for p in spec.params if p.form}
    for p in spec.params:
        assert options[p.name].help == p.help, f"{stage}.{p.name}: the CLI's help is not the spec's"
        if p.form:
            assert form[p.name]["description"] == p.help, f"{stage}.{p.name}: the form's help is not the spec's"
            assert form[p.name].get("default") == p.default, f"{stage}.{p.name}: the form's default differs"


def test_the_train_form_offers_the_knobs_people_change_as_typed_fields():
    form = _form("train")
    want = {
        "lr": "number", "steps": "integer", "batch_size": "integer", "group_size": "integer", "clip_low": "number",
        "clip_high": "number", "dynamic_sampling": "boolean", "overlong_shaping": "boolean", "seed": "integer",
    }  # fmt: skip
    for name, json_type in want.items():
        types_ = {alt.get("type") for alt in form[name].get("anyOf", [form[name]])}
        assert json_type in types_, f"train.{name}: {form[name]}"
        assert form[name]["default"] is None  # empty: the config's value
    choices = [alt for alt in form["loss_agg"]["anyOf"] if "enum" in alt]
    assert choices and "token-mean" in choices[0]["enum"] and "seq-mean-token-mean" in choices[0]["enum"]
    # the knob's help is the config schema's description of its key (written once, in dapo_core/config)
    assert "Eq. 10" in form["clip_high"]["description"] and "algorithm.clip_high" in form["clip_high"]["description"]


def test_every_knob_names_a_config_key_and_a_wrong_key_fails_at_import_time():
    for spec in P.STAGES.values():
        for p in spec.params:
            if p.key:
                P.field_at(p.key)
    with pytest.raises(ValueError, match=r"no config key 'trainer\.lrr'"):
        P.knob("trainer.lrr", "lrr")


def test_cli_knobs_reach_the_config_after_the_users_set_items():
    v = P.stage_values(
        P.TRAIN,
        {"overrides": ["algorithm.clip_high=0.5"], "clip_high": 0.3, "dynamic_sampling": False, "loss_agg": None},
    )
    cfg = load_config(recipe="tiny-dapo", overrides=v.overrides)
    assert cfg.algorithm.clip_high == 0.3  # the knob is applied last
    assert cfg.algorithm.dynamic_sampling.enable is False
    assert cfg.algorithm.loss_agg == load_config(recipe="tiny-dapo").algorithm.loss_agg  # empty: unchanged
    with pytest.raises(TypeError, match="unknown parameter"):
        P.stage_values(P.TRAIN, {"clip_higher": 0.3})


@pytest.fixture
def captured(monkeypatch) -> list[tuple[str, dict[str, Any]]]:
    """Replace each stage's flow with a recorder of the keyword arguments it is called with (as a flow run of its
    own, the CLI, or as the body of the deployment's run, ``.fn``)."""
    calls: list[tuple[str, dict[str, Any]]] = []

    class _Recorder:
        def __init__(self, stage: str) -> None:
            self.stage = stage

        def fn(self, **kw: Any) -> dict[str, Any]:
            calls.append((self.stage, kw))
            return {}

        def __call__(self, **kw: Any) -> dict[str, Any]:
            return self.fn(**kw)

    monkeypatch.setattr(stages, "stage_flow", _Recorder)
    return calls


def test_the_cli_and_the_deployment_call_the_flow_with_the_same_arguments(captured):
    """`dapo train --recipe tiny-dapo --lr 3e-4 --clip-high 0.3 --no-dynamic-sampling --set ...` and the train form
    with the same values reach train_flow with equal arguments (the CLI's own output is not checked here)."""
    args = ["--recipe", "tiny-dapo", "--lr", "3e-4", "--clip-high", "0.3", "--no-dynamic-sampling"]
    args += ["--set", "trainer.total_steps=2", "--loss-agg", "seq-mean-token-mean", "--resume"]
    runner.invoke(app, ["train", *args])
    S.train_deployment.fn(
        recipe="tiny-dapo", lr=3e-4, clip_high=0.3, dynamic_sampling=False, overrides=["trainer.total_steps=2"],
        loss_agg="seq-mean-token-mean", resume=True,
    )  # fmt: skip
    assert [stage for stage, _ in captured] == ["train", "train"]
    (_, from_cli), (_, from_form) = captured
    assert from_cli == from_form
    cfg = load_config(recipe="tiny-dapo", overrides=from_cli["overrides"])
    assert (cfg.trainer.lr, cfg.algorithm.clip_high, cfg.algorithm.dynamic_sampling.enable) == (3e-4, 0.3, False)
    assert cfg.algorithm.loss_agg == "seq-mean-token-mean" and from_cli["resume"] is True


def test_comma_separated_lists_on_the_cli_are_lists_in_the_form(captured):
    result = runner.invoke(app, ["ablation", "--rungs", "grpo,dapo", "--regimes", "tuned", "--quick", "--seeds", "1"])
    result_form = S.ablation_deployment.fn(rungs=["grpo", "dapo"], regimes=["tuned"], quick=True, seeds=1)
    assert result.exit_code != 2, result.output
    assert result_form == {}
    (_, from_cli), (_, from_form) = captured
    assert from_cli == from_form and from_cli["rungs"] == ["grpo", "dapo"] and from_cli["regimes"] == ["tuned"]


def test_a_bad_value_fails_the_same_way_from_the_cli_and_the_form(captured):
    result = runner.invoke(app, ["evaluate", "--k", "0"])
    assert result.exit_code == 2 and "k (0) must be >= 1" in result.output
    with pytest.raises(stages.StageInputError, match=r"k \(0\) must be >= 1"):
        stages.prepare("evaluate", P.stage_values(P.EVALUATE, {"k": 0}))
    bad = runner.invoke(app, ["train", "--recipe", "tiny-dapo", "--steps", "0", "--skip-plan"])
    assert bad.exit_code == 2 and "trainer.total_steps" in bad.output
    assert captured == []  # nothing ran


def test_adding_a_knob_is_one_line(monkeypatch):
    """The development page's example: a new entry in TRAIN's parameters is a CLI option and a form field."""
    extra = P.knob("trainer.grad_clip", "grad_clip")
    spec = dataclasses.replace(P.TRAIN, params=(*P.TRAIN.params, extra))
    monkeypatch.setitem(P.STAGES, "train", spec)
    flow = S._deployment_flow("train", "train_deployment")
    from prefect.utilities.callables import parameter_schema

    assert "grad_clip" in parameter_schema(flow).model_dump_for_openapi()["properties"]
    import typer

    from flows.cli.stage_command import stage_command

    probe = typer.Typer()
    stage_command(probe, spec, lambda v: print(v.overrides))
    out = CliRunner().invoke(probe, ["--grad-clip", "0.5"])
    assert out.exit_code == 0 and "trainer.grad_clip=0.5" in out.output
