"""Prefect flow-run bookkeeping across a crash: the flow run of a killed process must not stay RUNNING forever.

A process killed with SIGKILL cannot report its end, so its flow run stays RUNNING in the Prefect UI. When
`dapo train --resume` picks the work up, `mark_resumed` sets that flow run to CRASHED, with a message naming the
flow run that resumed it (and its UI address when a Prefect server is configured), so the UI tells the story.
"""

from __future__ import annotations

import logging
import os
from uuid import UUID

logger = logging.getLogger(__name__)


def current_flow_run() -> tuple[str, str] | None:
    """(id, name) of the flow run this code runs in, or None outside one."""
    from prefect.context import FlowRunContext

    ctx = FlowRunContext.get()
    if ctx is None or ctx.flow_run is None:
        return None
    return str(ctx.flow_run.id), ctx.flow_run.name


def _ui_link(flow_run_id: str) -> str:
    ui = os.environ.get("PREFECT_UI_URL") or os.environ.get("PREFECT_API_URL", "").removesuffix("/api")
    return f" ({ui.rstrip('/')}/runs/flow-run/{flow_run_id})" if ui else ""


def mark_resumed(old_flow_run_id: str | None) -> bool:
    """Set the interrupted flow run ``old_flow_run_id`` to CRASHED, naming the current flow run that resumed it.

    Does nothing (returns False) outside a flow run, for the current flow run itself, for a flow run already in a
    final state (it ended on its own), or for one this Prefect API does not know (another server's). Never raises:
    the bookkeeping must not stop a resume.
    """
    current = current_flow_run()
    if not old_flow_run_id or current is None or old_flow_run_id == current[0]:
        return False
    from prefect import get_client
    from prefect.states import Crashed

    new_id, new_name = current
    try:
        with get_client(sync_client=True) as client:
            old = client.read_flow_run(UUID(old_flow_run_id))
            if old.state is not None and old.state.is_final():
                return False
            message = (
                f"Interrupted: the process ended without reporting (killed or crashed) while this flow run was "
                f"{old.state.name if old.state else 'unknown'}; resumed by flow run {new_name} ({new_id})"
                f"{_ui_link(new_id)}"
            )
            client.set_flow_run_state(old.id, Crashed(message=message), force=True)
    except Exception as exc:  # another server's run, a bad id, an API hiccup: a warning, not a failed resume
        logger.warning("could not mark the interrupted flow run %s as crashed: %s", old_flow_run_id, exc)
        return False
    logger.info("flow run %s (interrupted) marked CRASHED; resumed by %s", old_flow_run_id, new_name)
    return True
