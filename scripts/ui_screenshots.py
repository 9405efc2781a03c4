"""The UI screenshots of docs/pipeline.md (one is in the README), taken from the real UIs in headless Chromium.

    make screenshots                                  # = .venv/bin/python scripts/ui_screenshots.py
    .venv/bin/python scripts/ui_screenshots.py --out /tmp/shots --keep
    .venv/bin/python scripts/ui_screenshots.py --prefect-url http://127.0.0.1:4300 --mlflow-url http://127.0.0.1:5300

By default it starts what `make ui` starts (a Prefect server, an MLflow server and `dapo serve`, flows/services/ui.py) on
free ports with their own stores in a temporary directory, where `dapo serve` also runs: the user's .prefect,
mlflow.db, outputs/ and a running `make ui` are not touched. Then, as a user would, it triggers two tiny runs from
the Prefect UI's Custom run form (the ``pipeline`` deployment with the tiny-dapo recipe, then ``train`` with
tiny-grpo on the same base model and data; about 2 minutes on 2 CPU cores; their numbers mean nothing), waits
for them and saves 1280x800 PNGs into docs/img/. Everything it started is stopped, also on an error; after an
error the temporary directory (server logs, failure.png) is kept and named.

With --prefect-url/--mlflow-url it uses servers that already run (`make ui`): the runs then execute where that
`dapo serve` runs and write its outputs/ (outputs/curated, outputs/base_model ...) and MLflow store, so use it
only with a scratch checkout's `make ui`.

Needs Debian's Chromium (scripts/ensure_chromium.sh) and the dev extra (playwright).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from flows.services import browser as B
from flows.services import ui

if TYPE_CHECKING:
    from playwright.sync_api import Page

REPO = Path(__file__).resolve().parents[1]
EXPERIMENT = "dapo-flow"
# tiny sizes: the whole pipeline in ~1 minute on 2 CPU cores (a 1-layer model, 20 warm-start steps, 8 RL steps)
SIZES = [
    "curation.synthetic.n=400", "curation.val_size=24", "base_model.steps=20", "base_model.heldout_size=16",
    "base_model.heldout_k=2", "model.tiny.hidden_size=32", "model.tiny.num_hidden_layers=1",
    "model.tiny.intermediate_size=64",
]  # fmt: skip
RL_SETS = [
    "trainer.total_steps=8", "trainer.test_freq=4", "trainer.save_freq=0", "data.train_batch_size=4",
    "trainer.ppo_mini_batch_size=2", "rollout.n=4", "rollout.val_n=2", "data.max_response_length=24",
    "algorithm.overlong.buffer_length=6", "tracking.log_system_metrics=false",
]  # fmt: skip
PIPELINE_SETS = [*SIZES, *RL_SETS, "data.gen_batch_size=8"]
GRPO_SETS = [*RL_SETS, "data.gen_batch_size=4"]  # no dynamic sampling: generate exactly the train batch


def _say(line: str) -> None:
    print(f"screenshots: {line}", flush=True)


@contextmanager
def own_uis(tmp: Path) -> Iterator[ui.UiSettings]:
    """`make ui`'s three processes on free ports with stores under ``tmp``; `dapo serve` runs in ``tmp/work``."""
    work = tmp / "work"
    work.mkdir()
    s = ui.UiSettings(
        prefect_port=ui.free_port(), mlflow_port=ui.free_port(), prefect_home=str(tmp / "prefect-home"),
        backend_store_uri=f"sqlite:///{tmp / 'mlflow.db'}", artifacts=str(tmp / "mlartifacts"),
        state_dir=str(tmp / "ui"), timeout_s=300,
    )  # fmt: skip
    cwd, poll = Path.cwd(), os.environ.get("PREFECT_RUNNER_POLL_FREQUENCY")
    os.environ["PREFECT_RUNNER_POLL_FREQUENCY"] = "1"  # `dapo serve` picks up a triggered run within a second
    os.chdir(work)  # the processes inherit it: `dapo serve` runs (and writes outputs/) there
    try:
        yield ui.start(s, say=_say)
    finally:
        ui.stop(s, say=_say)
        os.chdir(cwd)
        if poll is None:
            os.environ.pop("PREFECT_RUNNER_POLL_FREQUENCY", None)
        else:
            os.environ["PREFECT_RUNNER_POLL_FREQUENCY"] = poll


def submit_and_wait(page: Page, prefect_url: str, run_name: str) -> str:
    """Submit the filled Custom run form and watch the run's page until it completed; returns the run's id."""
    flow_run_id = B.submit_custom_run(page, run_name)
    _say(f"run {run_name!r} submitted ({prefect_url}/v2/runs/flow-run/{flow_run_id}); waiting ...")
    state = B.wait_for_flow_run(page, prefect_url, flow_run_id, timeout_s=1200)
    if state != "Completed":
        raise RuntimeError(f"flow run {run_name!r} ended {state}: its logs are in the Prefect UI and serve.log")
    return flow_run_id


def take(page: Page, out: Path, name: str) -> None:
    path = out / f"{name}.png"
    page.wait_for_timeout(1500)  # let charts and fonts settle
    page.screenshot(path=path)
    _say(f"{path} ({path.stat().st_size // 1024} KB)")


def mlflow_run_ids(mlflow_url: str, pipeline_id: str, grpo_id: str) -> tuple[str, str, str, str]:
    """(experiment id, the pipeline's parent run, tiny-dapo nested in it, tiny-grpo): run ids by Prefect tags."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=mlflow_url)
    exp = client.get_experiment_by_name(EXPERIMENT)
    if exp is None:
        raise RuntimeError(f"no MLflow experiment {EXPERIMENT!r} at {mlflow_url}")
    by_flow_run = "tags.`prefect.flow_run_id` = '{}'"
    (parent,) = client.search_runs([exp.experiment_id], by_flow_run.format(pipeline_id))
    child = f"tags.`mlflow.parentRunId` = '{parent.info.run_id}' and attributes.run_name = 'tiny-dapo'"
    (dapo,) = client.search_runs([exp.experiment_id], child)
    (grpo,) = client.search_runs([exp.experiment_id], by_flow_run.format(grpo_id))
    return exp.experiment_id, parent.info.run_id, dapo.info.run_id, grpo.info.run_id


def screenshots(page: Page, prefect_url: str, mlflow_url: str, out: Path) -> None:
    """The two runs from the Prefect UI, then the five pages (numbered in docs/pipeline.md's order)."""
    page.goto(f"{prefect_url}/v2/deployments")
    page.get_by_role("link", name="pipeline", exact=True).wait_for()

    # (b) the pipeline's Custom run form, filled; (c) its flow run page once it completed
    B.open_deployment(page, prefect_url, "pipeline")
    switches = {"dvc_commit": False}  # a scratch directory: no DVC project to record the outputs in
    B.fill_custom_run(page, run_name="tiny-pipeline", recipe="tiny-dapo", overrides=PIPELINE_SETS, switches=switches)
    page.get_by_role("heading", name="Parameters").scroll_into_view_if_needed()
    take(page, out, "prefect-custom-run")
    pipeline_id = submit_and_wait(page, prefect_url, "tiny-pipeline")
    page.get_by_text("[1/6] curate", exact=False).first.wait_for()  # the Logs tab's stage lines
    take(page, out, "prefect-flow-run")

    # the second run: GRPO on the same base model and data (the pipeline's outputs/base_model, outputs/curated)
    B.open_deployment(page, prefect_url, "train")
    B.fill_custom_run(page, run_name="tiny-grpo", recipe="tiny-grpo", overrides=GRPO_SETS)
    grpo_id = submit_and_wait(page, prefect_url, "tiny-grpo")

    # (a) the deployments page, now with their runs' activity
    page.goto(f"{prefect_url}/v2/deployments")
    page.get_by_role("link", name="train", exact=True).wait_for()
    take(page, out, "prefect-deployments")

    # (d) the experiment's runs table, the pipeline's nested runs shown; (e) tiny-dapo vs tiny-grpo compared
    exp_id, parent_id, dapo_id, grpo_run_id = mlflow_run_ids(mlflow_url, pipeline_id, grpo_id)
    page.goto(B.mlflow_page(mlflow_url, f"experiments/{exp_id}"))
    page.get_by_role("heading", name="Runs").wait_for()
    B.close_mlflow_assistant(page)
    B.expand_parent_run(page, parent_id)
    page.get_by_role("link", name="tiny-dapo", exact=True).wait_for()
    take(page, out, "mlflow-runs")
    page.goto(B.compare_runs_page(mlflow_url, exp_id, [dapo_id, grpo_run_id]))
    page.get_by_role("heading", name="Comparing 2 Runs from 1 Experiment").wait_for()
    B.close_mlflow_assistant(page)
    B.choose_compare_metric(page, "perf/time_per_step")
    take(page, out, "mlflow-compare")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "img", help="Folder of the PNGs (docs/img).")
    ap.add_argument("--prefect-url", help="A running Prefect server with `dapo serve` (make ui); default: own.")
    ap.add_argument("--mlflow-url", help="The running MLflow server that `dapo serve`'s runs log to.")
    ap.add_argument("--keep", action="store_true", help="Keep the temporary directory (stores, logs, outputs).")
    args = ap.parse_args(argv)
    if (args.prefect_url is None) != (args.mlflow_url is None):
        ap.error("give both --prefect-url and --mlflow-url (servers that run), or neither (own servers)")
    why = B.chromium_missing()
    if why:
        ap.error(f"{why} (scripts/ensure_chromium.sh installs Chromium)")
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="dapo-screenshots-"))
    failed = True
    from playwright.sync_api import sync_playwright

    try:
        with sync_playwright() as pw:
            browser = B.launch_chromium(pw)
            page = browser.new_page(viewport=B.VIEWPORT)
            page.set_default_timeout(60_000)  # a busy 2-core machine: the UIs' first loads take seconds
            try:
                if args.prefect_url:
                    urls = args.prefect_url.rstrip("/"), args.mlflow_url.rstrip("/")
                    _say(f"using the running UIs {urls[0]}, {urls[1]}: the runs write where their `dapo serve` runs")
                    screenshots(page, *urls, out)
                else:
                    with own_uis(tmp) as s:
                        _say(f"Prefect UI {s.prefect_url}, MLflow UI {s.mlflow_url} (stores in {tmp})")
                        screenshots(page, s.prefect_url, s.mlflow_url, out)
                failed = False
            except BaseException:
                page.screenshot(path=tmp / "failure.png")
                _say(f"failed at {page.url}; the page: {tmp}/failure.png; server logs: {tmp}/ui/*.log")
                raise
            finally:
                browser.close()
    finally:
        if args.keep or failed:
            _say(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
