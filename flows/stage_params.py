"""Each stage's parameters, declared once: the `dapo <stage>` command and the Prefect deployment both derive from here.

A stage's parameters are a list of ``Param``. ``flows/cli/stage_command.py`` turns one into a Typer option
(``--name-with-dashes`` unless ``flags`` says otherwise) and ``flows/serve.py`` into a typed field of the
deployment's form (name, type, default, help). A ``Param`` with a ``key`` is a config knob: its type and help come
from the config schema (``dapo_core/config``), its default is None (= the config's value), and a value that is set
becomes the ``--set key=value`` override applied after the user's own ``--set`` items. Anything else is passed to
the stage's runner (``flows/stages.py``) by name.

Adding an option to `dapo train` and to the train deployment is one line in ``TRAIN_PARAMS`` (a knob:
``knob("trainer.warmup_steps", "warmup_steps")``); see docs/development.md.
"""

from __future__ import annotations

import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic.fields import FieldInfo

from dapo_core.config.loader import is_union, section_at


@dataclass(frozen=True)
class Param:
    """One parameter of a stage: a CLI option and a field of the deployment form."""

    name: str  # Python name: the deployment's parameter and the runner's keyword
    type: Any  # its annotation (``int | None``, ``list[str]``, a ``Literal`` for a choice)
    default: Any
    help: str
    key: str | None = None  # config key this parameter sets (applied as a --set override, last)
    flags: tuple[str, ...] = ()  # CLI spellings, e.g. ("--config", "-c"); empty: --<name with dashes>
    split: bool = False  # CLI: a list option also takes comma-separated values (--rungs a,b)
    form: bool = True  # offered in the deployment form (False: CLI only)

    def cli_flags(self) -> tuple[str, ...]:
        return self.flags or (f"--{self.name.replace('_', '-')}",)


def field_at(key: str) -> FieldInfo:
    """The schema field of the dotted config ``key`` (e.g. ``trainer.lr``); ValueError when there is none."""
    *section, name = key.split(".")
    model = section_at(section)
    if model is None or name not in model.model_fields:
        raise ValueError(f"no config key {key!r} in the schema (dapo_core/config); see `dapo config show --flat`")
    return model.model_fields[name]


def _optional(annotation: Any) -> Any:
    """``annotation | None`` (a knob left empty keeps the config's value)."""
    if is_union(annotation) and type(None) in typing.get_args(annotation):
        return annotation
    return annotation | None


def knob(key: str, name: str, help: str | None = None, *, flags: tuple[str, ...] = ()) -> Param:
    """A config knob as a parameter: type and help from the schema's field of ``key``, default None."""
    info = field_at(key)
    text = help or (info.description or "").strip()
    return Param(
        name=name, type=_optional(info.annotation), default=None, key=key, flags=flags,
        help=f"{key}: {text} Empty: the config's value.",
    )  # fmt: skip


def default_config_value(key: str) -> Any:
    """The schema default of ``key`` (what an empty knob means when the config does not set it)."""
    return field_at(key).get_default(call_default_factory=True)


# --- the config every stage resolves first: --config or --recipe, then --set items, then the knobs ---
CONFIG_PARAMS: tuple[Param, ...] = (
    Param(
        "config_path", str | None, None, flags=("--config", "-c"),
        help="YAML config file (default: params.yaml, relative to the working directory); excludes the recipe.",
    ),
    Param(
        "recipe", str | None, None, flags=("--recipe", "-r"),
        help="Recipe name from recipes/ (`dapo config recipes`), e.g. tiny-dapo or tiny-grpo.",
    ),
    Param(
        "overrides", list[str], [], flags=("--set", "-s"),
        help='Override one key: "dotted.key=value" (value parsed as YAML); repeatable, applied in order, last '
        "wins, e.g. trainer.total_steps=4. An unknown key fails before any work.",
    ),
)  # fmt: skip

# --- the knobs people change between runs (the train and pipeline forms show them as typed fields) ---
RUN_KNOBS: tuple[Param, ...] = (
    knob("tracking.run_name", "run_name", "The MLflow run name and the output folder outputs/<run_name>/."),
    knob("trainer.seed", "seed", "Seed of the run; every sample's seed derives from it."),
    knob("trainer.lr", "lr"),
    knob("trainer.total_steps", "steps"),
    knob("data.train_batch_size", "batch_size"),
    knob("rollout.n", "group_size"),
    knob("algorithm.clip_low", "clip_low"),
    knob("algorithm.clip_high", "clip_high"),
    knob("algorithm.dynamic_sampling.enable", "dynamic_sampling", flags=("--dynamic-sampling/--no-dynamic-sampling",)),
    knob("algorithm.loss_agg", "loss_agg"),
    knob("algorithm.overlong.shaping", "overlong_shaping", flags=("--overlong-shaping/--no-overlong-shaping",)),
    knob("algorithm.overlong.filtering", "overlong_filtering", flags=("--overlong-filtering/--no-overlong-filtering",)),
)  # fmt: skip


@dataclass(frozen=True)
class StageSpec:
    """A stage: its CLI command / deployment name, the Prefect flow name, what it does, and its parameters."""

    name: str
    flow_name: str
    summary: str
    params: tuple[Param, ...] = field(default_factory=tuple)

    def param(self, name: str) -> Param:
        return next(p for p in self.params if p.name == name)


CURATE = StageSpec(
    "curate", "dapo-curate",
    "Validate, de-duplicate, normalise and split the curation sources; write train/val parquet and a data card.",
    (
        *CONFIG_PARAMS,
        Param("output_dir", str, "outputs/curated", "Where train/val parquet and the data card go.",
              flags=("--output-dir", "-o")),
        Param("generate_missing", bool, True, "Create the seeded synthetic raw file when it is missing.",
              flags=("--generate/--no-generate",)),
        Param("track", bool, True, "Record an MLflow run of the curation.", flags=("--track/--no-track",)),
    ),
)  # fmt: skip

BASE_MODEL = StageSpec(
    "base-model", "dapo-base-model",
    "Warm-start the tiny Qwen2 on synthetic worked solutions (SFT): the CPU default's base model (cached).",
    (
        *CONFIG_PARAMS,
        Param("output_dir", str, "outputs/base_model", "Where the HF model directory goes.",
              flags=("--output-dir", "-o")),
        Param("steps", int | None, None, "SFT optimizer steps; empty: base_model.steps."),
        Param("lr", float | None, None, "Peak SFT learning rate; empty: base_model.lr."),
        Param("batch_size", int | None, None, "Problems per SFT step; empty: base_model.batch_size."),
        Param("heldout_size", int | None, None, "Held-out problems scored at the end; empty: base_model.heldout_size."),
        Param("heldout_k", int | None, None, "Samples per held-out problem; empty: base_model.heldout_k."),
        Param("time_budget_s", float | None, None, "Stop SFT after this many seconds (breaks determinism).",
              flags=("--time-budget",)),
        Param("seed", int | None, None, "Warm-start seed; empty: trainer.seed."),
        Param("force", bool, False, "Rebuild even when the cached model's stamp matches.", flags=("--force",)),
    ),
)  # fmt: skip

TRAIN = StageSpec(
    "train", "dapo-train",
    "Train with DAPO (or the recipe's GRPO baseline): rollout -> reward -> filter -> update, tracked in MLflow.",
    (
        *CONFIG_PARAMS,
        *RUN_KNOBS,
        knob("model.path", "model_path", "The policy to start from: a local HF model directory or an HF id."),
        knob("data.train_files", "train_files", "verl-schema parquet files to train on.",
             flags=("--train-file",)),
        knob("data.val_files", "val_files", "Held-out parquet files scored during training.", flags=("--val-file",)),
        Param("resume", bool, False, "Continue the run named by run_name from its last complete checkpoint.",
              flags=("--resume",)),
        Param("force", bool, False, "With resume: continue even though the config differs from the checkpoint's.",
              flags=("--force",)),
        Param("skip_plan", bool, False, "Skip the pre-flight memory plan of a GPU config (`dapo plan`).",
              flags=("--skip-plan",), form=False),
    ),
)  # fmt: skip

EVALUATE = StageSpec(
    "evaluate", "dapo-evaluate",
    "Sample k responses per problem, score them; avg@k, pass@k, maj@k and reflection rate to MLflow and a JSON.",
    (
        *CONFIG_PARAMS,
        Param("model", str | None, None, "Local HF dir, runs:/ID/PATH, models:/NAME/VERSION or an HF id; empty: "
              "model.path.", flags=("--model", "-m")),
        Param("data", list[str] | None, None, "verl-schema parquet files (repeatable); empty: data.val_files.",
              flags=("--data", "-d")),
        Param("k", int | None, None, "Samples per problem (>= 1); empty: rollout.val_n (paper: 32).", flags=("--k",)),
        Param("ks", list[int] | None, None, "k values of pass@k / maj@k (each <= k), e.g. 1,4,8; empty: powers "
              "of two up to k.", flags=("--ks",), split=True),
        Param("seed", int | None, None, "Sampling seed; empty: derived from trainer.seed."),
        Param("run_name", str | None, None, "MLflow run name; empty: eval-<model>."),
        Param("metrics_path", str, "metrics/eval.json", "Metrics JSON (a DVC metric).", flags=("--out", "-o")),
    ),
)  # fmt: skip

PIPELINE = StageSpec(
    "pipeline", "dapo-pipeline",
    "The whole mission: curate -> base model (warm start) -> train (DAPO) -> evaluate -> controls, all tracked.",
    (
        *CONFIG_PARAMS,
        *RUN_KNOBS,
        Param("dvc_commit", bool, True, "Record the stage outputs in dvc.lock at the end (as make run does).",
              flags=("--dvc-commit/--no-dvc-commit",)),
    ),
)  # fmt: skip

ABLATION = StageSpec(
    "ablation", "dapo-ablation",
    "Table 1 in miniature: each DAPO technique added to GRPO in turn, per lr regime, vs supervised controls given "
    "the same CPU time. Default recipe: tiny-dapo-table1 (not params.yaml). Writes <name>.json/.md/.png, also "
    "logged to one parent MLflow run.",
    (
        *CONFIG_PARAMS,
        Param("regimes", list[str], ["tuned", "aggressive"], "lr regimes: tuned (the recipe's lr), aggressive (4x).",
              split=True),
        Param("tuned_lr", float | None, None, "lr of the tuned regime; empty: the recipe's trainer.lr."),
        Param("aggressive_lr", float | None, None, "lr of the aggressive regime; empty: 4x the recipe's."),
        Param("steps", int | None, None, "Gradient steps per run; empty: trainer.total_steps (quick: 2)."),
        Param("seeds", int | None, None, "Seeds 1..N per rung (>= 1); empty: 3 (quick: 1)."),
        Param("base", str | None, None, "Base model dir; empty: curate + warm start (reused if current)."),
        Param("out_dir", str | None, None, "Report dir; empty: benchmarks/results (quick: outputs/ablation-quick).",
              flags=("--out",)),
        Param("rungs", list[str] | None, None, "Rungs to run; empty: the Table-1 ladder and both controls: grpo, "
              "overlong-filtering, clip-higher, soft-overlong, token-level-loss, dapo; successors gspo, cispo, gmpo, "
              "dr-grpo; sft-control, sft-control-clean (need dapo).", split=True),
        Param("name", str, "ablation", "Report file stem: <out_dir>/<name>.json/.md/.png (e.g. successors)."),
        Param("resume", bool, False, "Reuse the finished runs journaled in <out_dir>/<name>.journal.jsonl whose "
              "config, base model and data are unchanged (after a kill or across sessions).", flags=("--resume",)),
        Param("eval_k", int | None, None, "Samples per held-out problem of each final score; empty: 32, Table 1's "
              "avg@32 (quick: rollout.val_n). Journaled runs scored at another k are scored again, not retrained."),
        Param("quick", bool, False, "A smoke run: one seed, 2 steps, both regimes.", flags=("--quick",)),
    ),
)  # fmt: skip

# stage name -> spec, in the order `dapo serve` lists the deployments
STAGES: dict[str, StageSpec] = {s.name: s for s in (CURATE, BASE_MODEL, TRAIN, EVALUATE, PIPELINE, ABLATION)}


@dataclass(frozen=True)
class StageValues:
    """The values of one call of a stage: the resolved config inputs and the runner's own arguments."""

    config_path: str | None
    recipe: str | None
    overrides: list[str]  # the user's --set items, then one per knob that is set
    args: dict[str, Any]  # every non-knob parameter except the config ones, by name

    def __getitem__(self, name: str) -> Any:
        return self.args[name]


def _override(key: str, value: Any) -> str:
    """``key=value`` with a value that parses back (as YAML) to what was given: JSON for everything but text."""
    import json

    return f"{key}={json.dumps(value)}"


def stage_values(spec: StageSpec, given: Mapping[str, Any]) -> StageValues:
    """Split the parameter values of one call (missing ones take their defaults) into config inputs and args."""
    values = {p.name: given.get(p.name, p.default) for p in spec.params}
    unknown = sorted(set(given) - set(values))
    if unknown:
        raise TypeError(f"{spec.name}: unknown parameter(s) {', '.join(unknown)}")
    knobs = [_override(p.key, values[p.name]) for p in spec.params if p.key and values[p.name] is not None]
    config_names = {p.name for p in CONFIG_PARAMS}
    args = {p.name: values[p.name] for p in spec.params if not p.key and p.name not in config_names}
    return StageValues(
        config_path=values["config_path"] or None, recipe=values["recipe"] or None,
        overrides=[*(values["overrides"] or []), *knobs], args=args,
    )  # fmt: skip
