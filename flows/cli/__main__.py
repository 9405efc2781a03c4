"""`python -m flows.cli ...` is `dapo ...` (the UI launcher and tests start commands this way)."""

from flows.cli import app

app()
