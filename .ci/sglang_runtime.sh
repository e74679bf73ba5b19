#!/usr/bin/env bash
# pagedqvg's SGLang entry-point plugin through SGLang 0.5.23's real runtime (.ci/sglang_runtime.py has the cases).
# Installs, into the Python given (a venv: the CI's, after its other steps), what SGLang's runtime imports on this
# path: sglang==0.5.23 --no-deps, addict, pyzmq, setproctitle, python-dateutil, msgspec, einops, psutil, openai,
# diffusers, transformers 5.19 + tokenizers (the tiny components); placeholder modules for the rest
# (.ci/sglang_placeholders.py, loaded in every process, spawned workers included, by a .pth file); the test-only
# plugin .ci/sglang_ci_cpu_ops (sgl-kernel CPU ops -> torch); and pagedqvg itself non-editable, so the entry point
# comes from the installed distribution's metadata. TORCHDYNAMO_DISABLE=1: SGLang's torch.compile'd native ops
# would compile C++ on a CPU for minutes.
#
# Then tests/test_integrations_sglang_lingbot.py (LingBot-World in-process, about a minute) unless only plugins.
#
# Usage: PYTHON=/path/to/venv/python .ci/sglang_runtime.sh [plugins|generate|all]
set -euo pipefail
cd "$(dirname "$0")/.."
repo="$(pwd)"
PYTHON="${PYTHON:-python}"
start=$(date +%s)
"$PYTHON" -c 'import sys; sys.exit(sys.prefix == sys.base_prefix)' || {
  echo "sglang_runtime: $PYTHON is not a virtual environment; this job installs packages into it" >&2; exit 1; }
work="$(mktemp -d)"
site="$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
pth="$site/zz_pagedqvg_ci_placeholders.pth"
cleanup() { rm -rf "$work" "$pth"; "$PYTHON" -m pip uninstall -q -y sglang-ci-cpu-ops >/dev/null 2>&1 || true; }
trap cleanup EXIT

"$PYTHON" -m pip install -q torch==2.13.0 'sglang==0.5.23' --no-deps
"$PYTHON" -m pip install -q torch==2.13.0 addict pyzmq setproctitle python-dateutil msgspec einops psutil openai \
  diffusers 'transformers==5.19.*' tokenizers safetensors
"$PYTHON" -m pip install -q --no-deps "$repo/.ci/sglang_ci_cpu_ops" "$repo"
echo "import sys; sys.path.append('$repo/.ci'); import sglang_placeholders" > "$pth"
echo "sglang_runtime: installed in $(( $(date +%s) - start )) s"

cd "$work"  # not the repo: pagedqvg must come from the installed distribution
TORCHDYNAMO_DISABLE=1 "$PYTHON" "$repo/.ci/sglang_runtime.py" "$work" "${1:-all}"
# LingBot-World in-process (item 7): SGLang's LingBotWorldCausalDMDDenoisingStage, its dense cache vs pagedqvg through
# install() (the test installs / uninstalls itself; SGLANG_PLUGINS keeps pagedqvg's entry point out). 3 passed.
if [ "${1:-all}" != plugins ]; then
  env -u PAGEDQVG_BUDGET -u PAGEDQVG_MEMORY_FRACTION SGLANG_PLUGINS=ci_cpu_ops TORCHDYNAMO_DISABLE=1 \
    "$PYTHON" -m pytest -q -p no:cacheprovider --rootdir "$repo" -c "$repo/pyproject.toml" \
    "$repo/tests/test_integrations_sglang_lingbot.py"
  echo "sglang_runtime: LingBot-World in-process done at $(( $(date +%s) - start )) s"
fi
# Leave the CI venv's pagedqvg editable again (the README's test command installed it so).
"$PYTHON" -m pip install -q --no-deps -e "$repo"
echo "sglang_runtime: done in $(( $(date +%s) - start )) s"
