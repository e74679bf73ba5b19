"""benchmarks/bench_forks.py --quick runs, exits 0, and writes its figures: 0 bytes copied by a fork at a chunk
boundary, 0 pages copied by the first advances, views equal after a host-tier round trip."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_bench_forks_quick(tmp_path):
    out = tmp_path / "forks.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_forks.py"), "--quick", "--repeats", "2", "--json", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(out.read_text(encoding="ascii"))
    assert got["fork_arena_bytes_changed"] == 0 and got["fork_used_pages_delta"] == 0
    assert got["first_advance_pages_copied_parent"] == 0 and got["first_advance_pages_copied_branch"] == 0
    assert got["mid_chunk_rewrite_pages_copied"] == got["mid_chunk_current_chunk_pages"] > 0
    assert got["views_equal_after_round_trip"] is True
    assert got["independent_pages"] > got["forked_pages"] > 0
    for key in ("fork_ms_per_layer", "swap_bytes", "swap_out_GBps", "swap_in_GBps", "planned_pages_independent"):
        assert key in got
