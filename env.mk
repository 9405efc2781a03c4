# Quiet and offline defaults for every tool. The `dapo` CLI sets the same values itself (dapo_core/env.py, which
# says beside each why it is needed), so running it outside make behaves the same.
PREFECT_HOME ?= $(CURDIR)/.prefect
PREFECT_SERVER_ANALYTICS_ENABLED ?= false
PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS ?= 120
MLFLOW_DISABLE_TELEMETRY ?= true
MLFLOW_SERVER_ENABLE_JOB_EXECUTION ?= false
DVC_NO_ANALYTICS ?= 1
RAY_USAGE_STATS_ENABLED ?= 0
RAY_AUTH_MODE ?= disabled
HF_HUB_DISABLE_PROGRESS_BARS ?= 1
HF_HUB_DISABLE_TELEMETRY ?= 1
DO_NOT_TRACK ?= 1
TOKENIZERS_PARALLELISM ?= false
