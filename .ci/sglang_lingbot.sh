#!/usr/bin/env bash
# LingBot-World through SGLang 0.5.23's real runtime on CPU (.ci/sglang_lingbot.py has the cases): a tiny
# random-weight LingBot-World directory (.ci/sglang_tiny_lingbot.py) through DiffGenerator (launcher + spawned
# worker), pagedqvg active vs excluded: one-shot image-to-video samples, realtime chunks of one session kept in the
# worker across calls (SGLang's realtime adapter and RealtimeSessionCache), and the worker's one-session limit.
#
# Installs, into the Python given (a virtual environment), what this path imports: sglang==0.5.23 --no-deps and the
# runtime deps .ci/sglang_runtime.sh installs (diffusers brings Pillow: the first frame, CLIP's PIL image-processor
# backend), triton (SGLang imports it at start-up); placeholder modules for the rest (.ci/sglang_placeholders.py, in
# every process by a .pth file); the test-only plugin .ci/sglang_ci_cpu_ops; pagedqvg non-editable.
# TORCHDYNAMO_DISABLE=1: SGLang's torch.compile'd native ops would compile C++ on a CPU for minutes.
#
# Usage: PYTHON=/path/to/venv/python .ci/sglang_lingbot.sh      (about 5 minutes on 2 cores; most of it start-up)
set -euo pipefail
cd "$(dirname "$0")/.."
repo="$(pwd)"
PYTHON="${PYTHON:-python}"
start=$(date +%s)
"$PYTHON" -c 'import sys; sys.exit(sys.prefix == sys.base_prefix)' || {
  echo "sglang_lingbot: $PYTHON is not a virtual environment; this job installs packages into it" >&2; exit 1; }
work="$(mktemp -d)"
site="$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
pth="$site/zz_pagedqvg_ci_placeholders.pth"
cleanup() { rm -rf "$work" "$pth"; "$PYTHON" -m pip uninstall -q -y sglang-ci-cpu-ops >/dev/null 2>&1 || true; }
trap cleanup EXIT

"$PYTHON" -m pip install -q torch==2.13.0 'sglang==0.5.23' --no-deps
"$PYTHON" -m pip install -q torch==2.13.0 addict pyzmq setproctitle python-dateutil msgspec einops psutil openai \
  diffusers 'transformers==5.19.*' tokenizers safetensors triton
"$PYTHON" -m pip install -q --no-deps "$repo/.ci/sglang_ci_cpu_ops" "$repo"
echo "import sys; sys.path.append('$repo/.ci'); import sglang_placeholders" > "$pth"
echo "sglang_lingbot: installed in $(( $(date +%s) - start )) s"

cd "$work"  # not the repo: pagedqvg must come from the installed distribution
TORCHDYNAMO_DISABLE=1 "$PYTHON" "$repo/.ci/sglang_lingbot.py" "$work"
# Leave the venv's pagedqvg editable again (the README's test command installed it so).
"$PYTHON" -m pip install -q --no-deps -e "$repo"
echo "sglang_lingbot: done in $(( $(date +%s) - start )) s"
