#!/usr/bin/env bash
# An install without Triton (as on macOS, Windows or a Linux CPU Triton has no wheel for): pagedqvg imports, its
# torch path works, and the tests that need Triton skip with a reason instead of failing.
#
#   .ci/no_triton.sh [extra pytest args]
#
# 1. The dependency markers: pyproject's requirements never require triton (pagedqvg imports it lazily; CUDA builds
#    of torch bring their own); the [test] extra, evaluated for macOS arm64, Windows x86_64 and Linux
#    ppc64le/x86_64/aarch64, requires it exactly on Linux x86_64 and aarch64 (where its wheels exist).
# 2. A fresh venv with torch (the README's 2.13.0 CPU wheel), sortedcontainers and the test tools, but no triton:
#    pip cannot be told it is on macOS for an editable install, so pagedqvg is installed with --no-deps (the deps it
#    declares for this platform minus triton are installed explicitly) and the script checks triton is absent.
# 3. `import pagedqvg` does not import triton; a quantized cache on CPU writes, packs and views through torch;
#    PAGEDQVG_KERNELS=triton raises a RuntimeError that says to install triton.
# 4. A quick test subset (kernel tests: their Triton parts skip; dispatch, PRQ, quant config, quantized cache).
#
# Environment: PYTHON (the interpreter that creates the venv; default python3), NO_TRITON_VENV (where; default a
# fresh temporary directory, removed afterwards). Exit status: non-zero on any failure.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
PYTHON="${PYTHON:-python3}"

# --- 1. markers -----------------------------------------------------------------------------------------------
"$PYTHON" - <<'EOF'
try:
    import tomllib
except ImportError:  # Python 3.10
    from pip._vendor import tomli as tomllib

try:
    from packaging.requirements import Requirement
except ImportError:  # pip vendors packaging
    from pip._vendor.packaging.requirements import Requirement

project = tomllib.load(open("pyproject.toml", "rb"))["project"]
deps = [Requirement(d) for d in project["dependencies"]]
test_deps = [Requirement(d) for d in project["optional-dependencies"]["test"]]
assert not any(d.name == "triton" for d in deps), f"triton is a hard dependency: {[str(d) for d in deps]}"
platforms = {  # (platform_system, sys_platform, platform_machine) -> triton expected
    ("Darwin", "darwin", "arm64"): False,
    ("Darwin", "darwin", "x86_64"): False,
    ("Windows", "win32", "AMD64"): False,
    ("Linux", "linux", "ppc64le"): False,
    ("Linux", "linux", "x86_64"): True,
    ("Linux", "linux", "aarch64"): True,
}
for (system, sys_platform, machine), want in platforms.items():
    env = {"platform_system": system, "sys_platform": sys_platform, "platform_machine": machine,
           "python_version": "3.11", "python_full_version": "3.11.9", "os_name": "nt" if system == "Windows" else "posix"}
    needed = {d.name for d in deps if d.marker is None or d.marker.evaluate(env)}
    testing = {d.name for d in test_deps if d.marker is None or d.marker.evaluate(env)}
    assert {"torch", "sortedcontainers"} <= needed and "triton" not in needed, (system, machine, needed)
    assert ("triton" in testing) == want, f"[test] needs triton on {system} {machine}: {'triton' in testing}, want {want}"
    print(f"no_triton: markers: {system:7} {machine:8} -> {sorted(needed)}; [test] adds triton: {'triton' in testing}")
torch_req = next(d for d in deps if d.name == "torch")
assert not any(s.operator in ("<", "<=", "==", "~=") for s in torch_req.specifier), f"torch is capped: {torch_req}"
EOF

# --- 2. a venv without triton -------------------------------------------------------------------------------------
if [[ -n "${NO_TRITON_VENV:-}" ]]; then
  venv="$NO_TRITON_VENV"
  rm -rf "$venv"
else
  tmp="$(mktemp -d)"
  venv="$tmp/venv"
  trap 'rm -rf "$tmp"' EXIT
fi
"$PYTHON" -m venv "$venv"
# shellcheck disable=SC1091
. "$venv/bin/activate"
pip install -q torch==2.13.0 'sortedcontainers>=2.4' 'pytest>=8' 'hypothesis>=6.100' 'numpy>=1.26'
pip install -q --no-deps -e .
if python -c "import triton" 2>/dev/null; then  # a torch build that depends on triton pulled it in
  echo "no_triton: the torch install brought triton; removing it for this check" >&2
  pip uninstall -q -y triton
fi
python -c "import triton" 2>/dev/null && { echo "no_triton: triton is still importable" >&2; exit 1; }

# --- 3. import and the torch path -----------------------------------------------------------------------------------
python - <<'EOF'
import os
import sys

import torch

import pagedqvg
from pagedqvg import BlockPool, PagedCausalKVCache, QuantConfig
from pagedqvg.kernels import dispatch

assert "triton" not in sys.modules, "import pagedqvg imported triton"
assert not dispatch.triton_available()
pool = BlockPool(capacity_bytes=256 * 1024, page_bytes=2048)
kw = dict(pool=pool, batch_size=1, cache_size=8, num_heads=2, head_dim=16, dtype=torch.bfloat16, device="cpu")
plain = PagedCausalKVCache(name="plain", **kw)
packed = PagedCausalKVCache(name="packed", quant=QuantConfig(bits=2, centroids=4, block_size=8, keep_recent_chunks=0,
                                                            sink=False), **kw)
g = torch.Generator().manual_seed(0)
for s in range(0, 16, 2):
    k, v = (torch.randn(1, 2, 2, 16, generator=g).to(torch.bfloat16) for _ in range(2))
    a = plain.update_and_get_attention_kv(key=k, value=v, current_chunk_start=s)
    b = packed.update_and_get_attention_kv(key=k, value=v, current_chunk_start=s)
    assert a.k.shape == b.k.shape and torch.isfinite(b.k.float()).all()
kinds = {kind for *_, kind in packed.last_view_sources()}
assert "packed" in kinds, kinds
assert "triton" not in sys.modules, "the torch path imported triton"
os.environ["PAGEDQVG_KERNELS"] = "triton"  # read when a cache is built
forced = PagedCausalKVCache(name="forced", **kw)
try:
    forced.update_and_get_attention_kv(key=k, value=v, current_chunk_start=0)
except RuntimeError as exc:
    assert "install triton" in str(exc), exc
else:
    raise AssertionError("PAGEDQVG_KERNELS=triton without triton did not raise")
print(f"no_triton: pagedqvg {getattr(pagedqvg, '__version__', '')} imports and packs on the torch path without "
      f"triton (views: {sorted(kinds)})")
EOF

# --- 3b. the command line: plan and a short real simulate on the CPU, without triton --------------------------
out="$(mktemp -d)"
pagedqvg plan --preset lingbot-world-mini > "$out/plan.txt"
python - "$out" <<'EOF'
import sys

from pagedqvg.cli.app import main

assert main(["simulate", "--preset", "lingbot-world-mini", "--chunks", "4", "--no-plot", "--no-progress",
             "--out", sys.argv[1]]) == 0
assert "triton" not in sys.modules, "pagedqvg simulate imported triton"
print("no_triton: pagedqvg plan and simulate run without triton")
EOF
rm -rf "$out"

# --- 4. the quick subset -----------------------------------------------------------------------------------------
status=0
python -m pytest -q -p no:cacheprovider -rs tests/test_kernels_page_write.py tests/test_kernels_view_build.py \
  tests/test_kernels_kmeans.py tests/test_kernels_dequant.py tests/test_kernels_residual_pack.py tests/test_kernels_view_runs.py \
  tests/test_kernels_dispatch.py tests/test_kernels_triton_common.py tests/test_quant_prq.py tests/test_quant_format.py \
  tests/test_quant_config.py tests/test_cache_quant.py "$@" || status=$?
echo "no_triton: exit $status after $((SECONDS - start)) s" >&2
exit "$status"
