"""The figure table the benchmarks print (`| figure | value |`, ints with thousands separators) and their JSON."""

from __future__ import annotations

import json


def report_figures(out: dict[str, object], json_path: str | None) -> None:
    """Print `out` as a two-column Markdown table; write it as JSON to `json_path` when given (None or '': not)."""
    print("| figure | value |\n|---|---|")
    for k, v in out.items():
        print(f"| {k} | {v:,} |" if isinstance(v, int) and not isinstance(v, bool) else f"| {k} | {v} |")
    if json_path:
        with open(json_path, "w", encoding="ascii") as fh:
            json.dump(out, fh, indent=1)
