#!/usr/bin/env bash
# pagedqvg's SGLang entry-point plugin through SGLang 0.5.23's real `sglang serve` (its CLI, launcher, FastAPI / uvicorn
# HTTP app and spawned scheduler worker) on CPU; .ci/sglang_serve.py has the cases.
# Installs, into the Python given (a venv: the CI's, after .ci/sglang_runtime.sh), what the server path imports for
# real: sglang==0.5.23 --no-deps, the runtime's packages (as sglang_runtime.sh) and the HTTP stack: fastapi, uvicorn,
# starlette, pydantic, python-multipart (FastAPI's form parsing, which SGLang's image / video routes declare), httpx,
# requests, orjson, uvloop, aiohttp; placeholder modules only for what this path still does not run
# (.ci/sglang_placeholders.py, by a .pth file, every process); the test-only plugin .ci/sglang_ci_cpu_ops (sgl-kernel
# CPU ops -> torch); pagedqvg non-editable (the entry point from the installed distribution's metadata).
# TORCHDYNAMO_DISABLE=1: SGLang's torch.compile'd native ops would compile C++ on a CPU for minutes.
#
# Usage: PYTHON=/path/to/venv/python .ci/sglang_serve.sh
set -euo pipefail
cd "$(dirname "$0")/.."
. .ci/sglang_venv.sh
sglang_venv sglang_serve 'triton==3.9.*' sortedcontainers fastapi 'uvicorn>=0.51' starlette pydantic python-multipart httpx requests orjson uvloop aiohttp

cd "$work"  # not the repo: pagedqvg must come from the installed distribution
TORCHDYNAMO_DISABLE=1 "$PYTHON" "$repo/.ci/sglang_serve.py" "$work"
# Leave the CI venv's pagedqvg editable again (the README's test command installed it so).
"$PYTHON" -m pip install -q --no-deps -e "$repo"
echo "sglang_serve: done in $(( $(date +%s) - start )) s"
