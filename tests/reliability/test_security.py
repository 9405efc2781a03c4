"""Security: secrets never reach MLflow, nothing executes or unpickles data, servers stay on loopback by default."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from tasks.redact import MASK, is_secret_key, redact, redact_items

REPO = Path(__file__).resolve().parents[2]
CODE_DIRS = ("dapo_core", "tasks", "flows", "benchmarks")
HF = "hf_" + "aB3dE5gH7jK9mN1pQ3sT5vW7yZ"  # token-shaped (built here so no scanner flags this file)


# ------------------------------------------------------------------------------------------------ redaction
@pytest.mark.parametrize(
    ("text", "secret"),
    [
        ("http://alice:s3cr3t-pw@mlflow.example:5000", "s3cr3t-pw"),
        ("postgresql://u:p4ssw0rd!@db/mlflow", "p4ssw0rd!"),
        (f"model.path=hub/{HF}/x", HF),
        ("key sk-" + "A" * 24 + " end", "sk-" + "A" * 24),
        ("ghp_" + "b" * 36, "ghp_" + "b" * 36),
        ("id AKIA" + "ABCDEFGHIJKLMNOP", "AKIA" + "ABCDEFGHIJKLMNOP"),
    ],
)
def test_redact_masks_each_kind_of_secret(text, secret):
    out = redact(text, environ={})
    assert secret not in out and MASK in out


def test_redact_masks_secret_env_values_anywhere_and_leaves_ordinary_text():
    env = {"HF_TOKEN": "plain-token-value-123", "MLFLOW_TRACKING_PASSWORD": "hunter2hunter2", "TOKENIZERS_PARALLELISM": "false-ish"}  # fmt: skip
    out = redact("loaded with plain-token-value-123 and hunter2hunter2; false-ish stays", environ=env)
    assert "plain-token-value-123" not in out and "hunter2hunter2" not in out and "false-ish stays" in out
    ordinary = "trainer.lr=0.0001 sqlite:///mlflow.db http://127.0.0.1:5000 Answer: 42 max_new_tokens=64"
    assert redact(ordinary, environ=env) == ordinary


def test_secret_keys_are_masked_whole_but_token_counts_are_not():
    assert is_secret_key("hub.token") and is_secret_key("db_password") and is_secret_key("openai_api_key")
    for key in ("rollout.max_num_batched_tokens", "rollout.max_new_tokens", "model.tokenizer_path"):
        assert not is_secret_key(key), key
    assert redact_items({"hub.token": "abc", "rollout.max_new_tokens": "64"}, environ={}) == {
        "hub.token": MASK,
        "rollout.max_new_tokens": "64",
    }


def test_no_secret_reaches_mlflow_params_tags_or_logged_files(tmp_path, monkeypatch):
    """A tracking-style URL with a password in the config, a token in the environment and in a log line: the
    params, tags and the logged log file in MLflow hold none of them."""
    from dapo_core.config import load_config
    from tasks import tracking

    monkeypatch.setenv("HF_TOKEN", HF)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    cfg = load_config(
        recipe="tiny-dapo",
        overrides=[
            f"tracking.uri={uri}",
            f"tracking.artifact_location={tmp_path}/art",
            "tracking.log_system_metrics=false",
            "resources.ray_address=ray://admin:r4y-s3cret@head.example:10001",
            f"model.revision={HF}",
        ],
        env={},
    )
    log = tmp_path / "train.log"
    log.write_text(f"INFO connecting with token {HF}\nINFO ray://admin:r4y-s3cret@head.example:10001\nstep 1 ok\n")
    with tracking.start_run(cfg, run_name="secrets", tags={"note": f"by {HF}"}) as run:
        tracking.log_params_flat(cfg)
        tracking.set_tags({"source": "ray://admin:r4y-s3cret@head.example:10001"})
        tracking.log_artifact(log, "logs")
    client = MlflowClient(tracking_uri=uri)
    data = client.get_run(run.info.run_id).data
    logged = "\n".join([*data.params.values(), *data.tags.values()])
    text = (Path(client.download_artifacts(run.info.run_id, "logs/train.log", str(tmp_path / "dl")))).read_text()
    for secret in (HF, "r4y-s3cret"):
        assert secret not in logged and secret not in text, secret
    assert data.params["resources.ray_address"] == f"ray://admin:{MASK}@head.example:10001"
    assert "step 1 ok" in text and data.params["trainer.lr"] == str(cfg.trainer.lr)


# ------------------------------------------------------------------------------------------------ code scan
def _calls(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else (
                f"{f.value.id}.{f.attr}" if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) else
                (f.attr if isinstance(f, ast.Attribute) else "")
            )  # fmt: skip
            yield node, name


def _kw(node: ast.Call, name: str):
    return next((k.value for k in node.keywords if k.arg == name), None)


UNPICKLERS = ("pickle.load", "pickle.loads", "marshal.loads", "shelve.open", "cloudpickle.loads", "dill.loads")


def scan(source: str, rel: str) -> list[str]:
    """What the code scan refuses in one file's source (see the test below)."""
    problems = []
    for node, name in _calls(ast.parse(source)):
        where = f"{rel}:{node.lineno} {name}"
        bare = isinstance(node.func, ast.Name)
        if (bare and name in ("eval", "exec", "compile")) or name in UNPICKLERS:
            problems.append(where)
        elif name == "torch.load":
            wo = _kw(node, "weights_only")
            if not (isinstance(wo, ast.Constant) and wo.value is True):
                problems.append(where + " without weights_only=True")
        elif name in ("yaml.load", "yaml.load_all", "yaml.unsafe_load"):
            loader = _kw(node, "Loader") or (node.args[1] if len(node.args) > 1 else None)
            text = ast.unparse(loader) if loader is not None else ""
            if name == "yaml.unsafe_load" or not text or "Unsafe" in text or text in ("yaml.Loader", "yaml.FullLoader"):
                problems.append(where + " with an unsafe loader")
        shell = _kw(node, "shell")
        if isinstance(shell, ast.Constant) and shell.value is True:
            problems.append(where + " shell=True")
        trc = _kw(node, "trust_remote_code")
        if isinstance(trc, ast.Constant) and trc.value is True:
            problems.append(where + " trust_remote_code=True")
    return problems


def test_no_code_executes_or_unpickles_data():
    """No eval/exec, no pickle/marshal/shelve loads, torch.load only with weights_only=True, yaml only through a
    safe loader, no shell=True, trust_remote_code never hard-wired on."""
    files = [p for d in CODE_DIRS for p in sorted((REPO / d).rglob("*.py"))]
    assert len(files) > 50
    problems = [line for p in files for line in scan(p.read_text(encoding="utf-8"), str(p.relative_to(REPO)))]
    assert not problems, "\n".join(problems)


def test_the_scan_catches_each_thing_it_refuses():
    bad = (
        "eval('1')\nexec('x')\npickle.loads(b'')\ntorch.load('x')\ntorch.load('x', weights_only=False)\n"
        "yaml.load('a', Loader=yaml.Loader)\nyaml.load('a')\nsubprocess.run('ls', shell=True)\n"
        "f(trust_remote_code=True)\n"
    )
    assert len(scan(bad, "bad.py")) == 9
    good = (
        "torch.load('x', weights_only=True)\nyaml.load('a', Loader=_Loader)\nmodel.eval()\nf(trust_remote_code=cfg.x)\n"
    )
    assert scan(good, "good.py") == []


def test_defaults_keep_servers_on_loopback_and_remote_code_off():
    from dapo_core.config import load_config
    from flows.services.ui import UiSettings

    assert UiSettings().host == "127.0.0.1"
    for recipe in ("tiny-dapo", "dapo-qwen2.5-32b"):
        assert load_config(recipe=recipe, env={}).model.trust_remote_code is False
