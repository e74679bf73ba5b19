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
. .ci/sglang_venv.sh
sglang_venv sglang_runtime

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
