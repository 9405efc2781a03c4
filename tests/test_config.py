"""Config schema, recipes and loader: every recipe validates, resolution order, rules, readable errors."""

from __future__ import annotations

import re
from datetime import datetime
from pathlib import Path

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from dapo_core.config import (
    ConfigError,
    DapoConfig,
    available_recipes,
    config_from_dict,
    dump_yaml,
    flatten_config,
    load_config,
    resolved_data_seed,
    resolved_max_new_tokens,
    resolved_norm_length,
    resolved_run_name,
    resolved_tracking_uri,
    unflatten_config,
)
from dapo_core.config.docs import render_knob_table

REPO = Path(__file__).resolve().parents[1]
SHIPPED = sorted(p.stem for p in (REPO / "recipes").glob("*.yaml"))
ABLATIONS = [
    "grpo-qwen2.5-32b",
    "ablation-1-overlong-filtering",
    "ablation-2-clip-higher",
    "ablation-3-soft-overlong",
    "ablation-4-token-level-loss",
    "ablation-5-dynamic-sampling",
]
SUCCESSORS = ["tiny-gspo", "tiny-cispo", "tiny-gmpo", "tiny-drgrpo"]  # issue 17: DAPO's successors


def tiny(*overrides: str) -> DapoConfig:
    return load_config(recipe="tiny-dapo", overrides=overrides, env={})


@pytest.fixture(scope="module")
def tiny_raw() -> dict:
    return tiny().model_dump(mode="json")


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


# ---------------- recipes ----------------


def test_the_expected_recipes_ship():
    assert set(SHIPPED) == {
        *ABLATIONS,
        "dapo-qwen2.5-32b",
        "dapo-qwen2.5-math-1.5b",
        "tiny-dapo",
        "tiny-dapo-table1",
        "tiny-grpo",
        *SUCCESSORS,
    }
    assert set(SHIPPED) <= set(available_recipes())


@pytest.mark.parametrize("name", SHIPPED)
def test_every_recipe_loads_validates_and_round_trips(name):
    cfg = load_config(recipe=name, env={})
    assert cfg.recipe == name
    assert load_config(recipe=f"{name}.yaml", env={}) == cfg
    assert config_from_dict(yaml.safe_load(dump_yaml(cfg))) == cfg
    assert unflatten_config(flatten_config(cfg)) == cfg


def test_dapo_32b_has_the_verl_script_values():
    cfg = load_config(recipe="dapo-qwen2.5-32b", env={})
    d, r, a, t, res = cfg.data, cfg.rollout, cfg.algorithm, cfg.trainer, cfg.resources
    assert cfg.model.path == "Qwen/Qwen2.5-32B" and cfg.model.dtype == "float32"  # fp32 master weights
    assert (cfg.trainer.strategy, cfg.trainer.fsdp.param_dtype, cfg.trainer.fsdp.reduce_dtype) == (
        "fsdp2",
        "bfloat16",
        "float32",
    )
    assert cfg.trainer.fsdp.cpu_offload and cfg.rollout.dtype == "bfloat16"  # offload=True in the script
    assert d.train_files == ["data/dapo-math-17k.parquet"] and d.val_files == ["data/aime-2024.parquet"]
    assert (d.train_batch_size, d.gen_batch_size, r.n, t.ppo_mini_batch_size) == (512, 1536, 16, 32)
    assert (d.max_prompt_length, d.max_response_length) == (2048, 20480)
    assert (a.overlong.shaping, a.overlong.buffer_length, a.overlong.penalty_factor) == (True, 4096, 1.0)
    assert (a.clip_low, a.clip_high, a.clip_c, a.loss_agg) == (0.2, 0.28, 10.0, "token-mean")
    ds = a.dynamic_sampling
    assert (ds.enable, ds.metric, ds.max_num_gen_batches) == (True, "acc", 10)
    assert (a.kl_coef, a.entropy_coef) == (0.0, 0.0)
    assert (t.lr, t.weight_decay, t.grad_clip, t.lr_warmup_steps, t.lr_scheduler) == (1e-6, 0.1, 1.0, 20, "constant")
    assert (r.temperature, r.top_p, r.top_k, r.val_top_p, r.val_n) == (1.0, 1.0, -1, 0.7, 32)
    assert (r.backend, r.tensor_parallel_size, r.max_num_batched_tokens) == ("vllm", 4, 22528)
    assert (res.executor, res.nnodes, res.n_gpus_per_node) == ("ray", 16, 8)
    assert (t.save_freq, t.test_freq, t.val_before_train) == (25, 5, True)
    # 16 gradient updates per rollout step, as the paper.
    assert d.train_batch_size // t.ppo_mini_batch_size == 16


def test_tiny_dapo_values():
    cfg = tiny()
    d, r, a, t = cfg.data, cfg.rollout, cfg.algorithm, cfg.trainer
    assert (cfg.model.path, cfg.model.dtype, d.template, t.device) == ("outputs/base_model", "float32", "tiny", "cpu")
    assert (r.backend, cfg.resources.executor) == ("hf", "local")
    assert (d.train_batch_size, d.gen_batch_size, r.n, t.ppo_mini_batch_size) == (32, 48, 8, 16)
    assert (t.micro_batch_size, d.max_prompt_length, d.max_response_length) == (32, 32, 80)
    assert (a.overlong.buffer_length, a.overlong.penalty_factor, a.clip_c) == (16, 1.0, 10.0)
    assert (t.lr, t.lr_warmup_steps, t.lr_scheduler, t.weight_decay, t.grad_clip) == (1e-4, 4, "constant", 0.0, 1.0)
    assert (t.total_steps, t.save_freq, t.test_freq, t.max_ckpt_to_keep) == (16, 8, 8, 2)
    b = cfg.base_model  # the run-on warm start (docs/results/learning.md)
    assert (b.steps, b.batch_size, b.target_greedy_acc, b.demos.run_on_frac, b.demos.run_on_style) == (
        1200,
        56,
        None,
        0.6,
        "answer_only",
    )
    assert (b.demos.shortcut_frac, b.demos.num_demos, b.demos.scarce_from_ops) == (0.0, None, None)
    assert (r.val_n, r.val_top_p) == (8, 1.0)
    assert (a.dynamic_sampling.enable, a.dynamic_sampling.max_num_gen_batches) == (True, 10)
    assert d.train_files[0].startswith("outputs/curated/") and d.val_files[0].startswith("outputs/curated/")
    tiny_model = cfg.model.tiny
    assert (tiny_model.hidden_size, tiny_model.num_hidden_layers, tiny_model.num_key_value_heads) == (128, 4, 2)


def _diff(a: DapoConfig, b: DapoConfig) -> set[str]:
    fa, fb = flatten_config(a), flatten_config(b)
    return {k for k in fa if fa[k] != fb[k]} - {"recipe"}


GRPO_DIFF = {
    "algorithm.clip_high",
    "algorithm.loss_agg",
    "algorithm.dynamic_sampling.enable",
    "algorithm.overlong.shaping",
    "data.gen_batch_size",
}


def test_grpo_recipes_differ_from_dapo_only_in_the_grpo_column():
    big = _diff(load_config(recipe="dapo-qwen2.5-32b", env={}), load_config(recipe="grpo-qwen2.5-32b", env={}))
    small = _diff(tiny(), load_config(recipe="tiny-grpo", env={}))
    assert big == GRPO_DIFF
    assert small == GRPO_DIFF | {"tracking.run_name"}
    grpo = load_config(recipe="tiny-grpo", env={}).algorithm
    assert (grpo.clip_low, grpo.clip_high, grpo.loss_agg) == (0.2, 0.2, "seq-mean-token-mean")


@pytest.mark.parametrize(
    ("step", "changed"),
    [
        (1, {"algorithm.overlong.filtering"}),
        (2, {"algorithm.clip_high"}),
        (3, {"algorithm.overlong.shaping"}),
        (4, {"algorithm.loss_agg"}),
        (5, {"algorithm.dynamic_sampling.enable", "data.gen_batch_size"}),
    ],
)
def test_each_ablation_adds_one_technique_to_the_previous(step, changed):
    before = load_config(recipe=ABLATIONS[step - 1], env={})
    after = load_config(recipe=ABLATIONS[step], env={})
    assert _diff(before, after) == changed


def test_last_ablation_is_dapo_plus_overlong_filtering():
    assert _diff(
        load_config(recipe="ablation-5-dynamic-sampling", env={}), load_config(recipe="dapo-qwen2.5-32b", env={})
    ) == {"algorithm.overlong.filtering"}


def test_params_yaml_is_the_resolved_tiny_dapo():
    assert load_config(REPO / "params.yaml", env={}) == tiny()


def test_knob_doc_is_up_to_date():
    doc = (REPO / "docs" / "recipe-knobs.md").read_text()
    assert doc == render_knob_table(), (
        "docs/recipe-knobs.md is stale: run `python -m dapo_core.config.docs > docs/recipe-knobs.md`"
    )


def test_knob_doc_lists_every_field():
    table = render_knob_table()
    for key in flatten_config(tiny()):
        assert f"| `{key}` |" in table


# ---------------- resolution order ----------------


def test_precedence_file_then_env_then_set(tmp_path):
    path = write(tmp_path / "c.yaml", "inherit: tiny-dapo\ntracking: {uri: file-uri}\nresources: {ray_address: f}\n")
    assert load_config(path, env={}).tracking.uri == "file-uri"
    env = {"MLFLOW_TRACKING_URI": "env-uri", "RAY_ADDRESS": "ray://env:10001"}
    cfg = load_config(path, env=env)
    assert (cfg.tracking.uri, cfg.resources.ray_address) == ("env-uri", "ray://env:10001")
    cfg = load_config(path, env=env, overrides=["tracking.uri=set-uri", "resources.ray_address=auto"])
    assert (cfg.tracking.uri, cfg.resources.ray_address) == ("set-uri", "auto")


def test_later_set_wins_and_values_parse_as_yaml():
    cfg = tiny(
        "trainer.lr=1e-5",
        "trainer.lr=3e-5",
        "data.train_files=[a.parquet, b.parquet]",
        "model.revision=null",
        "data.shuffle=false",
        "algorithm.clip_c=",
        "trainer.betas=[0.9, 0.95]",
    )
    assert cfg.trainer.lr == pytest.approx(3e-5)
    assert cfg.data.train_files == ["a.parquet", "b.parquet"]
    assert cfg.model.revision is None and cfg.algorithm.clip_c is None and cfg.data.shuffle is False
    assert cfg.trainer.betas == (0.9, 0.95)


def test_environment_defaults_to_os_environ(monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert load_config(recipe="tiny-dapo").tracking.uri == "http://127.0.0.1:5000"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "")  # empty means unset
    assert load_config(recipe="tiny-dapo").tracking.uri is None


def test_default_config_is_params_yaml_in_cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"params\.yaml not found.*tiny-dapo"):
        load_config(env={})
    write(tmp_path / "params.yaml", "inherit: tiny-grpo\ntrainer: {total_steps: 3}\n")
    cfg = load_config(env={})
    assert (cfg.recipe, cfg.trainer.total_steps, cfg.algorithm.loss_agg) == ("params", 3, "seq-mean-token-mean")


def test_config_and_recipe_together_is_an_error():
    with pytest.raises(ConfigError, match=r"both --config .* and --recipe"):
        load_config(REPO / "params.yaml", recipe="tiny-dapo", env={})


def test_cwd_recipes_come_first_and_inherit_deep_merges(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write(tmp_path / "recipes" / "mine.yaml", "inherit: tiny-dapo\nalgorithm: {overlong: {buffer_length: 8}}\n")
    cfg = load_config(recipe="mine", env={})
    assert cfg.recipe == "mine" and "mine" in available_recipes()
    # Siblings of the overridden key survive the merge.
    assert (cfg.algorithm.overlong.buffer_length, cfg.algorithm.overlong.shaping) == (8, True)
    assert cfg.algorithm.clip_high == 0.28


def test_missing_recipe_lists_available_and_suggests(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"'tiny-dap' not found \(did you mean 'tiny-dapo'\?\).*tiny-grpo"):
        load_config(recipe="tiny-dap", env={})


def test_inherit_cycle_is_detected(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write(tmp_path / "recipes" / "a.yaml", "inherit: b\n")
    write(tmp_path / "recipes" / "b.yaml", "inherit: c\n")
    write(tmp_path / "recipes" / "c.yaml", "inherit: a\n")
    with pytest.raises(ConfigError, match=r"inheritance cycle a -> b -> c -> a"):
        load_config(recipe="a", env={})
    write(tmp_path / "recipes" / "self.yaml", "inherit: self\n")
    with pytest.raises(ConfigError, match=r"cycle self -> self"):
        load_config(recipe="self", env={})


# ---------------- readable errors ----------------


def test_bad_yaml_names_file_and_line(tmp_path):
    path = write(tmp_path / "bad.yaml", "recipe: x\ndata:\n  train_batch_size: 32\n   gen_batch_size: 48\n")
    with pytest.raises(ConfigError, match=rf"{path}:4:\d+: invalid YAML"):
        load_config(path, env={})


def test_duplicate_yaml_key_names_its_line(tmp_path):
    path = write(tmp_path / "dup.yaml", "recipe: x\ntrainer:\n  lr: 1e-4\n  lr: 1e-5\n")
    with pytest.raises(ConfigError, match=rf"{path}:4:\d+: .*duplicate key 'lr'"):
        load_config(path, env={})


@pytest.mark.parametrize(
    ("yaml_text", "pattern"),
    [
        ("trainr: {}", r"unknown key 'trainr': did you mean 'trainer'\?"),
        ("trainer: {lr_warmup: 3}", r"unknown key 'trainer.lr_warmup': did you mean 'trainer.lr_warmup_steps'\?"),
        (
            "algorithm: {overlong: {bufer_length: 3}}",
            r"'algorithm.overlong.bufer_length': did you mean 'algorithm.overlong.buffer_length'\?.*penalty_factor",
        ),
        ("model: {tiny: {hidden: 64}}", r"'model.tiny.hidden': did you mean 'model.tiny.hidden_size'\?"),
    ],
)
def test_unknown_yaml_key_at_any_depth(tmp_path, yaml_text, pattern):
    path = write(tmp_path / "c.yaml", f"inherit: tiny-dapo\n{yaml_text}\n")
    with pytest.raises(ConfigError, match=pattern):
        load_config(path, env={})


@pytest.mark.parametrize(
    ("override", "pattern"),
    [
        ("trainer.lr_warmup=3", r"did you mean 'trainer.lr_warmup_steps'\?.*valid keys of trainer: total_steps"),
        ("algorithm.dynamic_sampling.enabled=true", r"did you mean 'algorithm.dynamic_sampling.enable'\?"),
        ("rolout.n=4", r"unknown key 'rolout': did you mean 'rollout'\?"),
        ("data.train_files.x=1", r"'data.train_files' is a value, not a section"),
        ("trainer.lr", r"must look like dotted.key=value"),
    ],
)
def test_bad_set_keys(override, pattern):
    with pytest.raises(ConfigError, match=pattern):
        tiny(override)


RULES = [
    (
        ["trainer.ppo_mini_batch_size=7"],
        r"trainer.ppo_mini_batch_size \(7\) must divide data.train_batch_size \(32\): pick a divisor such as 4 or 8",
    ),
    (["data.gen_batch_size=16"], r"data.gen_batch_size \(16\) must be >= data.train_batch_size \(32\)"),
    (["algorithm.clip_low=-0.1"], r"algorithm.clip_low \(-0.1\) must be in \[0, 1\)"),
    (["algorithm.clip_high=0.1"], r"algorithm.clip_low \(0.2\) must be <= algorithm.clip_high \(0.1\)"),
    (["algorithm.clip_c=1.0"], r"algorithm.clip_c \(1.0\) must be > 1 when set"),
    (
        ["algorithm.overlong.buffer_length=80"],
        r"algorithm.overlong.buffer_length \(80\) must be < data.max_response_length \(80\) when .*shaping is on",
    ),
    (["rollout.n=1"], r"rollout.n \(1\) must be >= 2 when algorithm.dynamic_sampling.enable is on"),
    (["rollout.top_p=0"], r"rollout.top_p \(0.0\) must be in \(0, 1\]"),
    (["rollout.val_top_p=1.5"], r"rollout.val_top_p \(1.5\) must be in \(0, 1\]"),
    (["rollout.top_k=0"], r"rollout.top_k \(0\) must be -1 \(off\) or >= 1"),
    (["algorithm.norm_length=100"], r"algorithm.norm_length \(100\) only applies to loss_agg"),
    (["rollout.max_new_tokens=81"], r"rollout.max_new_tokens \(81\) must be <= data.max_response_length \(80\)"),
    (
        ["rollout.backend=vllm", "rollout.tensor_parallel_size=2"],
        r"rollout.tensor_parallel_size \(2\) > 1 needs GPUs but resources.n_gpus_per_node is 0",
    ),
    (["model.tiny.num_attention_heads=3"], r"model.tiny.num_attention_heads \(3\) must divide"),
    (["trainer.betas=[0.9, 1.0]"], r"trainer.betas \(\[0.9, 1.0\]\) must each be in \[0, 1\)"),
    # Field-level rules, formatted the same way: key (value) rule: fix.
    (["data.train_batch_size=0"], r"data.train_batch_size \(0\) must be > 0"),
    (["rollout.n=0"], r"rollout.n \(0\) must be > 0"),
    (["trainer.lr=-1"], r"trainer.lr \(-1\) must be > 0"),
    (["rollout.backend=sglang"], r"rollout.backend \('sglang'\) must be one of 'hf' or 'vllm'"),
    (["algorithm.loss_agg=mean"], r"algorithm.loss_agg \('mean'\) must be one of 'token-mean'"),
    (["trainer.total_steps=many"], r"trainer.total_steps \('many'\) must be a valid integer"),
    (["data=5"], r"data \(5\) must be a section"),
    (["trainer.strategy=fsdp2"], r"trainer.strategy \('fsdp2'\) shards the model over trainer ranks.*executor=ray"),
    (["trainer.strategy=zero3"], r"trainer.strategy \('zero3'\) must be one of 'ddp' or 'fsdp2'"),
    (["trainer.fsdp.param_dtype=int8"], r"trainer.fsdp.param_dtype \('int8'\) must be one of"),
]


@pytest.mark.parametrize(("overrides", "pattern"), RULES)
def test_each_rule_fails_with_value_rule_and_fix(overrides, pattern):
    with pytest.raises(ConfigError, match=pattern) as info:
        tiny(*overrides)
    message = str(info.value)
    assert "pydantic" not in message and "validation error" not in message.lower()
    for problem in info.value.problems:  # "dotted.key (value) rule: fix"
        assert re.fullmatch(r"[a-z_.]+ \(.+\) [^:]+.*: .+", problem), problem


def test_the_rules_hold_where_they_should():
    tiny("rollout.n=1", "algorithm.dynamic_sampling.enable=false")  # n=1 is fine without dynamic sampling
    tiny("algorithm.overlong.buffer_length=80", "algorithm.overlong.shaping=false")
    tiny("algorithm.clip_high=0.2", "algorithm.clip_c=null")
    tiny("algorithm.loss_agg=seq-mean-token-sum-norm", "algorithm.norm_length=100")
    tiny("rollout.backend=vllm", "resources.n_gpus_per_node=1", "rollout.tensor_parallel_size=1")
    tiny("trainer.strategy=fsdp2", "resources.executor=ray")


def test_several_problems_are_reported_together():
    with pytest.raises(ConfigError) as info:
        tiny("trainer.ppo_mini_batch_size=7", "rollout.top_p=0", "rollout.top_k=0")
    assert len(info.value.problems) == 3
    assert str(info.value).count("\n  - ") == 3


@given(train=st.integers(1, 96), mini=st.integers(1, 96))
def test_mini_batch_rule_is_exactly_divisibility(tiny_raw, train, mini):
    raw = {**tiny_raw, "data": {**tiny_raw["data"], "train_batch_size": train, "gen_batch_size": train}}
    raw["trainer"] = {**tiny_raw["trainer"], "ppo_mini_batch_size": mini}
    if train % mini == 0:
        assert config_from_dict(raw).trainer.ppo_mini_batch_size == mini
    else:
        with pytest.raises(ConfigError, match=r"pick a divisor such as") as info:
            config_from_dict(raw)
        suggested = [int(x) for x in str(info.value).rsplit("such as ", 1)[1].split(" or ")]
        assert all(train % s == 0 for s in suggested)


# ---------------- flatten / resolution helpers ----------------

_text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=12).filter(lambda s: s != "null")


@given(
    lr=st.floats(1e-9, 1.0, allow_nan=False),
    seed=st.one_of(st.none(), st.integers(-(2**31), 2**31)),
    run_name=st.one_of(st.none(), _text),
    experiment=_text,
    files=st.lists(_text, max_size=3),
    betas=st.tuples(st.floats(0, 0.999), st.floats(0, 0.999)),
    clip_c=st.one_of(st.none(), st.floats(1.01, 100)),
)
def test_flatten_unflatten_round_trip(tiny_raw, lr, seed, run_name, experiment, files, betas, clip_c):
    raw = {**tiny_raw}
    raw["trainer"] = {**raw["trainer"], "lr": lr, "betas": betas}
    raw["data"] = {**raw["data"], "seed": seed, "train_files": files}
    raw["tracking"] = {**raw["tracking"], "run_name": run_name, "experiment": experiment}
    raw["algorithm"] = {**raw["algorithm"], "clip_c": clip_c}
    cfg = config_from_dict(raw)
    flat = flatten_config(cfg)
    assert all(isinstance(v, str) for v in flat.values())
    assert unflatten_config(flat) == cfg


def test_flatten_keys_are_dotted_and_mlflow_safe():
    flat = flatten_config(tiny())
    assert flat["algorithm.dynamic_sampling.enable"] == "true"
    assert flat["data.seed"] == "null" and flat["trainer.lr"] == "0.0001"
    assert all(set(k) <= set("abcdefghijklmnopqrstuvwxyz_0123456789.") for k in flat)


def test_resolved_helpers_do_not_mutate():
    cfg = load_config(recipe="dapo-qwen2.5-32b", env={})
    assert resolved_run_name(cfg, now=datetime(2025, 3, 17, 9, 5, 7)) == "dapo-qwen2.5-32b-20250317-090507"
    assert cfg.tracking.run_name is None
    assert resolved_run_name(tiny()) == "tiny-dapo"
    assert resolved_tracking_uri(cfg) == "sqlite:///mlflow.db"
    assert resolved_max_new_tokens(cfg) == 20480 and resolved_data_seed(cfg) == 42
    assert resolved_norm_length(cfg) is None
    assert resolved_norm_length(tiny("algorithm.loss_agg=seq-mean-token-sum-norm")) == 80


def test_empty_section_means_defaults(tmp_path):
    path = write(tmp_path / "c.yaml", "recipe: x\nrollout:\n  backend: hf\ntracking:\nresources:\n")
    cfg = load_config(path, env={})
    assert cfg.tracking.experiment == "dapo-flow" and cfg.recipe == "x"


def test_inherit_of_a_missing_recipe_names_the_inheriting_file(tmp_path):
    path = write(tmp_path / "c.yaml", "inherit: tiny-dapoo\n")
    with pytest.raises(FileNotFoundError, match=rf"{path}: inherit: recipe 'tiny-dapoo' not found \(did you mean"):
        load_config(path, env={})


def test_new_experiments_keep_artifacts_beside_a_local_store_and_on_a_tracking_server():
    from dapo_core.config import resolved_artifact_location

    local = load_config(recipe="tiny-dapo", env={})
    assert resolved_artifact_location(local) == "./mlartifacts"
    # a server decides (its served root): a local path here would leave the artifacts on the machine that logs
    served = load_config(recipe="tiny-dapo", env={"MLFLOW_TRACKING_URI": "http://tracking.test:5000"})
    assert resolved_artifact_location(served) is None
    chosen = load_config(recipe="tiny-dapo", overrides=["tracking.artifact_location=s3://b/p"], env={})
    assert resolved_artifact_location(chosen) == "s3://b/p"
