"""`python -m tools.triton_report [--arch 90] [--no-compile] [--report [--json]]`: specialization keys and PTX of the
Triton kernels for a CUDA target, or (--report) registers, spills and shared memory at the presets' shapes; no GPU."""

from __future__ import annotations

import json
import sys

from tools.triton_report import aot
from tools.triton_report import resources as triton_resources


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=aot.__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability as an int (90 = H100/H200)")
    parser.add_argument("--no-compile", action="store_true", help="only the specialization keys (fast)")
    parser.add_argument("--report", action="store_true",
                        help="registers, spills and shared memory of every kernel at the model shapes (a table)")
    parser.add_argument("--json", action="store_true", help="with --report: the rows as JSON")
    args = parser.parse_args(argv)
    if args.report:
        rows = triton_resources.report(args.arch)
        if args.json:
            print(json.dumps(rows))
        else:
            print(f"sm_{args.arch}, ptxas -v of the triton {aot.triton_version()} wheel, batch 1, bf16")
            print(triton_resources.format_table(rows))
        return 0
    json.dump(aot.report(args.arch, not args.no_compile), sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
