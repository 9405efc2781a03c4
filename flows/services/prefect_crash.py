"""Flow runs whose process died are marked CRASHED by the Prefect server itself, not left RUNNING forever.

A flow run started by a worker sends a heartbeat event every ``PREFECT_FLOWS_HEARTBEAT_FREQUENCY`` seconds (the
stack sets it in the worker's environment, which its flow-run processes inherit). A process killed with SIGKILL, or
a machine that goes away, sends nothing more; this automation (Prefect's own mechanism for "zombie" flow runs, a
proactive event trigger per flow run) sets such a run CRASHED once ``crash_after_s`` seconds pass without a heartbeat
or an end. `dapo train --resume` (or the deployment run again with ``resume``) then continues the work.
"""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

from flows.services.ui import http_request

NAME = "dapo: crash flow runs without heartbeats"
ENDS = ("Completed", "Failed", "Cancelled", "Crashed")


def automation(crash_after_s: int) -> dict[str, Any]:
    """The automation's JSON body (built with Prefect's own schema, so a Prefect that changes it fails here)."""
    from prefect.client.schemas.objects import StateType
    from prefect.events.actions import ChangeFlowRunState
    from prefect.events.schemas.automations import AutomationCore, EventTrigger, Posture
    from prefect.events.schemas.events import ResourceSpecification

    message = (
        f"No heartbeat for {crash_after_s} s: the process running this flow run is gone (killed, or its worker or "
        "machine died). Resume the work: run the deployment again with resume=true, or `dapo train --resume`."
    )
    core = AutomationCore(
        name=NAME,
        description="Marks a flow run CRASHED when its heartbeats stop (set up by `dapo stack start`).",
        trigger=EventTrigger(
            after={"prefect.flow-run.heartbeat"},
            expect={"prefect.flow-run.heartbeat", *(f"prefect.flow-run.{end}" for end in ENDS)},
            match=ResourceSpecification({"prefect.resource.id": ["prefect.flow-run.*"]}),
            for_each={"prefect.resource.id"},
            posture=Posture.Proactive,
            threshold=1,
            within=timedelta(seconds=crash_after_s),
        ),
        actions=[ChangeFlowRunState(state=StateType.CRASHED, message=message)],
    )
    return json.loads(core.model_dump_json())


def ensure(api: str, crash_after_s: int) -> str:
    """Create the automation on the Prefect server at ``api`` (``.../api``), or replace one of the same name whose
    settings differ; returns its id. RuntimeError when the server does not take it."""
    body = automation(crash_after_s)
    code, text = http_request(f"{api}/automations/filter", {"automations": {"name": {"any_": [NAME]}}}, timeout=30)
    if code != 200:
        raise RuntimeError(f"listing Prefect's automations failed (HTTP {code}) at {api}")
    for found in json.loads(text):
        if found["trigger"].get("within") == body["trigger"]["within"] and found.get("enabled"):
            return str(found["id"])
        code, _ = http_request(f"{api}/automations/{found['id']}", method="DELETE", timeout=30)
        if code not in (200, 204):
            raise RuntimeError(f"removing the outdated automation {found['id']} failed (HTTP {code})")
    code, text = http_request(f"{api}/automations/", body, timeout=30)
    if code != 201:
        raise RuntimeError(f"creating the automation {NAME!r} failed (HTTP {code}): {text[:300]}")
    return str(json.loads(text)["id"])
