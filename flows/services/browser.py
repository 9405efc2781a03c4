"""The project's UIs driven in headless Chromium, the way a user clicks through them (Playwright).

Used by the browser test (tests/test_ui_browser.py) and the README's screenshots (scripts/ui_screenshots.py):

    with sync_playwright() as pw:
        browser = launch_chromium(pw)
        page = browser.new_page(viewport=VIEWPORT)
        flow_run_id = start_custom_run(page, prefect_url, "curate", run_name="ui-curate", overrides=[...])
        assert wait_for_flow_run(page, prefect_url, flow_run_id) == "Completed"

The browser is Debian's ``chromium`` (``/usr/bin/chromium``, ``apt-get install chromium``; ``make test`` installs
it where missing), never one Playwright downloads. Pages: the Prefect UI's current ("V2") pages under ``/v2/``
(where http://127.0.0.1:4200 leads), the MLflow UI in its model-training view (``?workflowType=machine_learning``).
Selectors follow what a user reads (link and button names, parameter labels); the UIs' markup is that of Prefect
3.9 and MLflow 3.17 (constraints.txt).
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING

from tasks.tracking import MODEL_TRAINING_VIEW

if TYPE_CHECKING:
    from playwright.sync_api import Browser, Locator, Page, Playwright, ViewportSize

CHROMIUM = os.environ.get("DAPO_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]
VIEWPORT: ViewportSize = {"width": 1280, "height": 800}
TERMINAL_STATES = ("Completed", "Failed", "Crashed", "Cancelled")
FLOW_RUN_URL = re.compile(r"/runs/flow-run/([0-9a-f-]{36})")


def chromium_missing() -> str | None:
    """Why the browser cannot run here (no Chromium binary, no playwright package), or None."""
    import importlib.util

    if importlib.util.find_spec("playwright") is None:
        return "the playwright package is not installed (pip install -c constraints.txt -e '.[dev]')"
    if not Path(CHROMIUM).is_file():
        return f"no Chromium at {CHROMIUM} (apt-get install -y chromium; `make test` does it where missing)"
    return None


def launch_chromium(pw: Playwright) -> Browser:
    """Debian's Chromium, headless, no sandbox (root in CI), no GPU, no background traffic."""
    return pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)


# ---------------------------------------------------------------- Prefect UI


def parameter(page: Page, name: str) -> Locator:
    """The block of one parameter in a deployment's run form: its label ``<name> (Optional)`` and its input."""
    return page.locator(f"xpath=//form//label[starts-with(normalize-space(.), '{name} ')]/ancestor::div[fieldset][1]")


def open_deployment(page: Page, prefect_url: str, deployment: str) -> None:
    """The deployments page, then the deployment (by its name, e.g. ``curate``)."""
    page.goto(f"{prefect_url}/v2/deployments")
    page.get_by_role("link", name=deployment, exact=True).click()
    page.get_by_role("button", name="Run", exact=True).wait_for()


def fill_custom_run(
    page: Page,
    *,
    run_name: str,
    config_path: str | None = None,
    recipe: str | None = None,
    overrides: tuple[str, ...] | list[str] = (),
    fields: dict[str, str] | None = None,
    switches: dict[str, bool] | None = None,
) -> None:
    """On a deployment's page: Run -> Custom run, then fill the form (Submit is left to the caller).

    ``config_path`` / ``recipe`` switch the optional field from None to str and type the value; each override is
    one "Add item" of the ``overrides`` list; ``fields`` are other text parameters (``{"run_name": "x"}``);
    ``switches`` set boolean parameters (``{"dvc_commit": False}``)."""
    page.get_by_role("button", name="Run", exact=True).click()
    page.get_by_role("menuitem", name="Custom run").click()
    page.get_by_role("heading", name="Parameters").wait_for()
    page.locator("input[name=name]").fill(run_name)  # the flow run's name
    for name, value in (("config_path", config_path), ("recipe", recipe)):
        if value is not None:
            block = parameter(page, name)
            block.get_by_role("tab", name="str").click()
            block.locator("textarea, input").first.fill(value)
    block = parameter(page, "overrides")
    for item in overrides:
        block.get_by_role("button", name="Add item").click()
        block.locator("textarea").last.fill(item)
    for name, value in (fields or {}).items():
        block = parameter(page, name)
        if block.get_by_role("tab", name="str").count():
            block.get_by_role("tab", name="str").click()
        block.locator("textarea, input").first.fill(value)
    for name, on in (switches or {}).items():
        switch = parameter(page, name).get_by_role("switch")
        if (switch.get_attribute("aria-checked") == "true") != on:
            switch.click()
    name_input = page.locator("input[name=name]")
    if name_input.input_value() != run_name:  # the form's generated name arrived after ours: type it again
        name_input.fill(run_name)


def submit_custom_run(page: Page, run_name: str, timeout_s: float = 120.0) -> str:
    """Submit the filled form and open the new run's page; returns the flow run's id (from its address).

    Prefect's UI goes to the new flow run's page, or back to the deployment's runs (then the run is opened by its
    name). A form that stays put fails with what the page says (its toasts and alerts), not a bare timeout."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    form_url = page.url
    try:  # a Submit that stays disabled (the form found an error) times out here too
        page.get_by_role("button", name="Submit").click(timeout=timeout_s * 1000)
        page.wait_for_url(lambda url: url != form_url, timeout=timeout_s * 1000)
    except PlaywrightTimeout as error:
        raise AssertionError(
            f"the run form did not submit within {timeout_s:.0f}s ({page.url}); the page says: {page_messages(page)}; "
            f"{str(error).splitlines()[0]}"
        ) from None
    if not FLOW_RUN_URL.search(page.url):
        page.get_by_role("link", name=run_name, exact=True).first.click()
        page.wait_for_url(FLOW_RUN_URL)
    match = FLOW_RUN_URL.search(page.url)
    assert match, page.url
    return match.group(1)


def page_messages(page: Page) -> str:
    """The toasts, alerts and form-field messages on the page (why a submission failed, say), or "(nothing)"."""
    found = page.locator("[data-sonner-toast], [role=alert], [role=status], [data-slot=form-message]")
    texts = found.all_inner_texts()
    return " | ".join(" ".join(t.split()) for t in texts if t.strip()) or "(nothing)"


def start_custom_run(page: Page, prefect_url: str, deployment: str, *, run_name: str, **form: object) -> str:
    """Deployments -> ``deployment`` -> Run -> Custom run -> fill -> Submit -> the run's page; returns its id."""
    open_deployment(page, prefect_url, deployment)
    fill_custom_run(page, run_name=run_name, **form)  # type: ignore[arg-type]
    return submit_custom_run(page, run_name)


def flow_run_state(page: Page) -> str | None:
    """The state badge at the top of a flow run page (``Completed``, ``Running`` ...), or None before it shows."""
    badges = page.locator("main [data-slot=badge]").filter(has_text=re.compile(r"^\s*[A-Z][a-zA-Z]+\s*$"))
    # one snapshot of every badge's text: counting, then reading the i-th, waits forever for a badge that a
    # re-render removed in between (seen: a Completed run's page timed out on badge 1 of a list of 2)
    for text in (t.strip() for t in badges.all_inner_texts()):
        if text in (*TERMINAL_STATES, "Scheduled", "Pending", "Running", "Late", "Paused", "Cancelling"):
            return text
    return None


def wait_for_flow_run(page: Page, prefect_url: str, flow_run_id: str, timeout_s: float = 600.0) -> str:
    """Watch the flow run's page until its badge shows a final state; returns that state.

    The page updates itself while the run goes on; it is reloaded every 30 s in case an update was missed."""
    url = f"{prefect_url}/v2/runs/flow-run/{flow_run_id}"
    if not page.url.startswith(url):
        page.goto(url)
    deadline, reload_at = time.monotonic() + timeout_s, time.monotonic() + 30
    state = None
    while time.monotonic() < deadline:
        state = flow_run_state(page)
        if state in TERMINAL_STATES:
            return state
        if time.monotonic() > reload_at:
            page.reload()
            reload_at = time.monotonic() + 30
        page.wait_for_timeout(1000)
    raise TimeoutError(f"flow run {flow_run_id} still {state!r} after {timeout_s:.0f}s ({url})")


# ---------------------------------------------------------------- MLflow UI


def mlflow_page(mlflow_url: str, route: str) -> str:
    """An MLflow UI address in the model-training view: ``route`` like ``experiments/1`` or ``experiments/1/runs/x``."""
    return f"{mlflow_url}/#/{route.lstrip('/')}?{MODEL_TRAINING_VIEW}"


def close_mlflow_assistant(page: Page) -> None:
    """Close the assistant side panel MLflow opens on a browser's first visit (it hides part of the page)."""
    close = page.locator("button[aria-label=Close]")
    if close.count() and close.first.is_visible():
        close.first.click()


def expand_parent_run(page: Page, run_id: str) -> None:
    """In an experiment's runs table: the +/- button left of a parent run's name shows its nested runs."""
    cell = page.locator("div.ag-cell", has=page.locator(f"a[href$='/runs/{run_id}']"))
    cell.locator("button").first.click()


def compare_runs_page(mlflow_url: str, experiment_id: str, run_ids: list[str]) -> str:
    """The MLflow UI's "Comparing N Runs" page (parameters, metrics, parallel coordinates) of ``run_ids``."""
    runs = ",".join(f'"{r}"' for r in run_ids)
    return f'{mlflow_url}/#/compare-runs?runs=[{runs}]&experiments=["{experiment_id}"]&{MODEL_TRAINING_VIEW}'


def choose_compare_metric(page: Page, metric: str) -> None:
    """On the compare page: the parallel coordinates plot's metric axis shows ``metric`` (instead of the first)."""
    select = page.locator("xpath=//div[normalize-space(text())='Metrics:']/following-sibling::div[1]")
    remove = select.locator("[class$=select-selection-item-remove]")
    for _ in range(remove.count()):
        remove.first.click()
    select.click()
    page.keyboard.type(metric)
    page.locator(f"[class*=select-item-option][title='{metric}']").click()
    page.keyboard.press("Escape")
