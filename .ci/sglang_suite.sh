#!/usr/bin/env bash
# SGLang 0.5.23's own kv-cache unit tests (three files, unmodified; 50 run on CPU) against pagedqvg through
# pagedqvg.integrations.sglang.install(). The SGLang wheel is fetched with pip at test time into a temporary
# folder (never committed, never installed); SGLang's heavy third-party imports that these tests never exercise
# are placeholder modules (.ci/sglang_plugin.py), so nothing but the wheel is downloaded.
#
# Expected: 49 passed, 1 skipped (CUDA + quant-videogen only), 1 deselected: test_causal_kv_cache_block_resets_
# indices_in_place asserts `cache.k is k` and assigns `cache.k`, i.e. it writes the dense buffer directly, which
# pagedqvg does not have (README "Use with SGLang": documented difference). It is then run alone and must fail on
# exactly that assertion, so the difference stays what the README says.
#
# Usage: PYTHON=/path/to/python .ci/sglang_suite.sh   (a Python with torch, pytest and pagedqvg importable)
set -euo pipefail
cd "$(dirname "$0")/.."
repo="$(pwd)"
PYTHON="${PYTHON:-python}"
start=$(date +%s)
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

"$PYTHON" -m pip download -q --no-deps 'sglang==0.5.23' -d "$work/wheel"
"$PYTHON" - "$work" <<'PY'
import glob, sys, zipfile
work = sys.argv[1]
(wheel,) = glob.glob(f"{work}/wheel/sglang-0.5.23-*.whl")
with zipfile.ZipFile(wheel) as z:
    # The sglang package without its __init__ (a namespace package then: the package __init__ pulls in the
    # serving runtime, which the kv-cache tests never use).
    names = [n for n in z.namelist() if n.startswith("sglang/") and n != "sglang/__init__.py"]
    z.extractall(f"{work}/src", members=names)
print(f"sglang_suite: {len(names)} files of {wheel.rsplit('/', 1)[1]} extracted")
PY

tests=(
  sglang/multimodal_gen/test/unit/test_qvg_packed_kv.py
  sglang/multimodal_gen/test/unit/realtime/test_causal_denoising.py
  sglang/multimodal_gen/test/unit/realtime/test_lingbot_causal_denoising.py
)
documented=sglang/multimodal_gen/test/unit/realtime/test_causal_denoising.py::test_causal_kv_cache_block_resets_indices_in_place
export PYTHONPATH="$work/src:$repo:$repo/.ci${PYTHONPATH:+:$PYTHONPATH}"
cd "$work/src"
"$PYTHON" -m pytest -q -p no:cacheprovider -p sglang_plugin "${tests[@]}" --deselect "$documented"

# The documented difference, alone: it must fail, and on the buffer identity.
set +e
out="$("$PYTHON" -m pytest -q -p no:cacheprovider -p sglang_plugin "$documented" 2>&1)"
rc=$?
set -e
if [ "$rc" -eq 0 ] || ! grep -q "assert cache.k is k" <<<"$out"; then
  echo "$out" | tail -20
  echo "sglang_suite: $documented was expected to fail on 'assert cache.k is k' (README documents it); it did not" >&2
  exit 1
fi
echo "sglang_suite: documented difference confirmed ($documented fails on 'assert cache.k is k')"

# Attention mode `pages` on SGLang's real LongLive2 stage (tiny random-weight transformer; quant off within 2e-3 of
# SGLang's dense cache, view mode exact, int2 for scale): tests/test_integrations_sglang_pages.py's real-stage test.
cd "$repo"
PAGEDQVG_SGLANG_SRC="$work/src" "$PYTHON" -m pytest -q -p no:cacheprovider tests/test_integrations_sglang_pages.py \
  -k real_longlive2
# Sessions on SGLang's real LingBot-World stage forward and RealtimeSession (pages kept across realtime calls, 0 after
# dispose and after one-shot calls): tests/test_integrations_sglang_sessions.py's real-stage test (~1 min); and the
# host tier there (tests/test_integrations_sglang_host_tier.py: 3 realtime sessions on a pool of two planned peaks,
# swapped out between calls and back at the next one, every chunk equal to the sessions run alone).
PAGEDQVG_SGLANG_SRC="$work/src" "$PYTHON" -m pytest -q -p no:cacheprovider tests/test_integrations_sglang_sessions.py \
  tests/test_integrations_sglang_host_tier.py -k real_lingbot
# The rollout benchmark's core at tiny size on SGLang's real LongLive2 stage (6 chunks, scene cuts and pins; quant
# off bit for bit SGLang's dense cache, int4 and the recommended tiers at or below int2 at every chunk): ~30-70 s.
PAGEDQVG_SGLANG_SRC="$work/src" "$PYTHON" -m pytest -q -p no:cacheprovider tests/test_bench_sglang_rollout.py
cd "$work/src"
echo "sglang_suite: done in $(( $(date +%s) - start )) s"
