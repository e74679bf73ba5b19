#!/usr/bin/env bash
# The float-sensitive tests again, with the CPU math libraries forced onto other instruction sets than this machine's.
#
#   .ci/portability.sh [extra pytest args]
#
# Which fp32 summation order a BLAS or a vectorised kernel uses depends on the CPU it runs on: torch's own kernels
# (ATEN_CPU_CAPABILITY), its BLAS (MKL: MKL_ENABLE_INSTRUCTIONS) and numpy's OpenBLAS, which Triton's interpreter uses
# for tl.dot (OPENBLAS_CORETYPE). Tests that compare two float paths must hold whichever order each side takes
# (exact only where the arithmetic is exact, else within a proven bound), so these files run here twice more:
#   avx2:    OPENBLAS_CORETYPE=Haswell  ATEN_CPU_CAPABILITY=avx2    MKL_ENABLE_INSTRUCTIONS=AVX2
#            (the reporter's AMD EPYC without AVX-512, where 4 tests used to fail)
#   generic: OPENBLAS_CORETYPE=Prescott ATEN_CPU_CAPABILITY=default MKL_ENABLE_INSTRUCTIONS=SSE4_2
# A combination the CPU lacks falls back to what it has (the run then repeats the native one). The avx2 run is
# skipped where the CPU has no AVX-512 (avx2 is then the native set, which the main suite ran). ~9 min on 2 cores.
#
# Environment: PYTHON (default the `python` on PATH). Exit status: non-zero if any run fails.
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ -z "${PYTHON:-}" ]]; then
  PYTHON="$(command -v python || command -v python3)"
fi
unset PAGEDQVG_KERNELS TRITON_INTERPRET  # the kernel test files choose (the interpreter on a CPU-only machine)

# The torch-vs-Triton k-means and pack comparisons and the cache-level views over packed segments ...
kernel_files=(tests/test_kernels_kmeans.py tests/test_kernels_dequant.py tests/test_kernels_residual_pack.py
  tests/test_kernels_view_runs.py)
kernel_select="kmeans or packed_views or packed_store or mixed_views or fp8"
# ... and the PRQ / quantized-cache files (k-means in torch: tiling, accuracy bounds, dense-vs-packed views), and
# attention from pages against fp64 attention within the proven bound of tests/float_bounds.py (torch tiles and
# SGLang's mode `pages`; the Triton attention files run in the interpreter, whose tl.dot is numpy's: OPENBLAS_CORETYPE).
torch_files=(tests/test_quant_prq.py tests/test_quant_format.py tests/test_cache_quant.py tests/test_synthetic.py
  tests/test_attention.py tests/test_integrations_sglang_pages.py)
# The Triton attention kernels (interpreter: tl.dot is numpy's OpenBLAS) within the same bound, in the generic run
# only (95 s CPU, 2-4.5 min wall on 2 cores).
generic_files=(tests/test_attention_triton.py tests/test_attention_split.py)

start=$SECONDS
status=0
combos=("generic Prescott default SSE4_2")
if grep -qw avx512f /proc/cpuinfo 2>/dev/null; then
  combos=("avx2 Haswell avx2 AVX2" "${combos[@]}")
fi
for combo in "${combos[@]}"; do
  read -r name openblas aten mkl <<<"$combo"
  export OPENBLAS_CORETYPE=$openblas ATEN_CPU_CAPABILITY=$aten MKL_ENABLE_INSTRUCTIONS=$mkl
  # What the libraries report they use (a check that the variables take effect on this machine).
  "$PYTHON" - "$name" <<'EOF' || true
import sys

import torch

print(f"portability: {sys.argv[1]}: torch CPU capability {torch.backends.cpu.get_cpu_capability()}", file=sys.stderr)
EOF
  t0=$SECONDS
  "$PYTHON" -m pytest -q -p no:cacheprovider "${kernel_files[@]}" -k "$kernel_select" "$@" || status=1
  "$PYTHON" -m pytest -q -p no:cacheprovider "${torch_files[@]}" "$@" || status=1
  if [[ $name == generic ]]; then
    "$PYTHON" -m pytest -q -p no:cacheprovider "${generic_files[@]}" "$@" || status=1
  fi
  echo "portability: $name ($openblas/$aten/$mkl) done in $((SECONDS - t0)) s" >&2
done
echo "portability: exit $status after $((SECONDS - start)) s" >&2
exit "$status"
