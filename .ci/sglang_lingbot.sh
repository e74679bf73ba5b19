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
. .ci/sglang_venv.sh
sglang_venv sglang_lingbot triton

cd "$work"  # not the repo: pagedqvg must come from the installed distribution
TORCHDYNAMO_DISABLE=1 "$PYTHON" "$repo/.ci/sglang_lingbot.py" "$work"
# Leave the venv's pagedqvg editable again (the README's test command installed it so).
"$PYTHON" -m pip install -q --no-deps -e "$repo"
echo "sglang_lingbot: done in $(( $(date +%s) - start )) s"
