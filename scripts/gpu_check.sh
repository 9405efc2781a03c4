#!/usr/bin/env bash
# FSDP2 checks on a lent GPU (see scripts/gpu_check.py): writes benchmarks/results/gpu.json and gpu.md.
#   scripts/gpu_check.sh              # CUDA: one rank per GPU, backend cpu:gloo,cuda:nccl, ~5-10 min on one H100
#   scripts/gpu_check.sh --dry-run    # CPU: 2 gloo ranks, tiny shapes (--out DIR, default a temp dir)
# Needs torch (+CUDA), transformers; not vLLM, Ray, Prefect or pydantic. Python: $GPU_CHECK_PYTHON, else
# .venv/bin/python when present, else python3.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${GPU_CHECK_PYTHON:-}"  # not $PYTHON: the Makefile exports PYTHON=python3 (the venv-building python)
if [[ -z "$python" ]]; then
  if [[ -x "$root/.venv/bin/python" ]]; then python="$root/.venv/bin/python"; else python="python3"; fi
fi
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
export TOKENIZERS_PARALLELISM=false
exec "$python" "$root/scripts/gpu_check.py" "$@"
