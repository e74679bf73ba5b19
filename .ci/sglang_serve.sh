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
repo="$(pwd)"
PYTHON="${PYTHON:-python}"
start=$(date +%s)
"$PYTHON" -c 'import sys; sys.exit(sys.prefix == sys.base_prefix)' || {
  echo "sglang_serve: $PYTHON is not a virtual environment; this job installs packages into it" >&2; exit 1; }
work="$(mktemp -d)"
site="$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
pth="$site/zz_pagedqvg_ci_placeholders.pth"
cleanup() { rm -rf "$work" "$pth"; "$PYTHON" -m pip uninstall -q -y sglang-ci-cpu-ops >/dev/null 2>&1 || true; }
trap cleanup EXIT

"$PYTHON" -m pip install -q torch==2.13.0 'sglang==0.5.23' --no-deps
"$PYTHON" -m pip install -q torch==2.13.0 'triton==3.9.*' sortedcontainers addict pyzmq setproctitle python-dateutil \
  msgspec einops psutil openai diffusers 'transformers==5.19.*' tokenizers safetensors \
  fastapi 'uvicorn>=0.51' starlette pydantic python-multipart httpx requests orjson uvloop aiohttp
"$PYTHON" -m pip install -q --no-deps "$repo/.ci/sglang_ci_cpu_ops" "$repo"
echo "import sys; sys.path.append('$repo/.ci'); import sglang_placeholders" > "$pth"
echo "sglang_serve: installed in $(( $(date +%s) - start )) s"

cd "$work"  # not the repo: pagedqvg must come from the installed distribution
TORCHDYNAMO_DISABLE=1 "$PYTHON" "$repo/.ci/sglang_serve.py" "$work"
# Leave the CI venv's pagedqvg editable again (the README's test command installed it so).
"$PYTHON" -m pip install -q --no-deps -e "$repo"
echo "sglang_serve: done in $(( $(date +%s) - start )) s"
