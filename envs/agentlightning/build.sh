#!/usr/bin/env bash
# Agent Lightning 0.3.0's own venv at .venvs/agentlightning (Python 3.11), the peer for side-by-side benchmarks.
# Idempotent: does nothing once .venvs/agentlightning/.installed exists. ~4.5 min and ~1.7 GB the first time.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="$ROOT/.venvs/agentlightning"
C="$ROOT/envs/agentlightning/constraints.txt"
[ -e "$VENV/.installed" ] && exit 0
"${PYTHON:-python3.11}" -m venv "$VENV"
"$VENV/bin/pip" install -q -c "$C" torch==2.13.0  # first, the CPU wheel: agentlightning would otherwise pull CUDA torch
"$VENV/bin/pip" install -q -c "$C" agentlightning==0.3.0
touch "$VENV/.installed"
