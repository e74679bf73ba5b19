# Sourced by .ci/sglang_runtime.sh, .ci/sglang_serve.sh and .ci/sglang_lingbot.sh (after `set -euo pipefail`):
# `sglang_venv JOB [PACKAGE ...]` checks that $PYTHON is a virtual environment, makes $work (a temporary folder),
# installs into $PYTHON sglang==0.5.23 --no-deps, the packages SGLang's runtime imports on the CPU path plus the
# extra PACKAGEs, the test-only plugin .ci/sglang_ci_cpu_ops and pagedqvg non-editable (the entry point from the
# installed distribution's metadata), and loads .ci/sglang_placeholders.py in every process (spawned workers
# included) by a .pth file. An EXIT trap removes $work, the .pth file and the plugin.
# Sets: repo, PYTHON, start, work.

sglang_venv() {
  local job="$1"; shift
  repo="$(pwd)"
  PYTHON="${PYTHON:-python}"
  start=$(date +%s)
  "$PYTHON" -c 'import sys; sys.exit(sys.prefix == sys.base_prefix)' || {
    echo "$job: $PYTHON is not a virtual environment; this job installs packages into it" >&2; exit 1; }
  work="$(mktemp -d)"
  local site
  site="$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  _sglang_pth="$site/zz_pagedqvg_ci_placeholders.pth"
  trap 'rm -rf "$work" "$_sglang_pth"; "$PYTHON" -m pip uninstall -q -y sglang-ci-cpu-ops >/dev/null 2>&1 || true' EXIT

  "$PYTHON" -m pip install -q torch==2.13.0 'sglang==0.5.23' --no-deps
  "$PYTHON" -m pip install -q torch==2.13.0 addict pyzmq setproctitle python-dateutil msgspec einops psutil openai \
    diffusers 'transformers==5.19.*' tokenizers safetensors "$@"
  "$PYTHON" -m pip install -q --no-deps "$repo/.ci/sglang_ci_cpu_ops" "$repo"
  echo "import sys; sys.path.append('$repo/.ci'); import sglang_placeholders" > "$_sglang_pth"
  echo "$job: installed in $(( $(date +%s) - start )) s"
}
