"""The `pagedqvg` command: plan tables and JSON for every preset, simulate outputs, exit status 2 on bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pagedqvg.cli import PLAN_SCHEMA, main, parse_size
from pagedqvg.simulate import SUMMARY_SCHEMA, TIMELINE_FIELDS

FULL_PRESETS = ["lingbot-world", "longlive2", "self-forcing"]
# A small, fast simulate workload (~100 calls of 2 layers).
TINY_SIM = ["--preset", "lingbot-world-mini", "--layers", "2", "--heads", "2", "--tokens-per-frame", "16",
            "--chunks", "9", "--denoise-steps", "2", "--page-bytes", "16KiB", "--no-progress"]


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# ---------------------------------------------------------------------------------------------------- plan
@pytest.mark.parametrize("preset", FULL_PRESETS)
def test_plan_table(capsys, preset: str) -> None:
    code, out, err = run(capsys, "plan", "--preset", preset)
    assert code == 0 and err == ""
    for text in ("dense bf16 (reference)", "paged bf16 *", "paged int4", "paged int2", "transient view",
                 "budget needed", f"pagedqvg plan: {preset}"):
        assert text in out


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@pytest.mark.parametrize("preset", FULL_PRESETS)
def test_plan_json_schema(capsys, preset: str) -> None:
    code, out, _ = run(capsys, "plan", "--preset", preset, "--json", "--budget", "40GiB")
    assert code == 0
    doc = json.loads(out)
    assert doc["schema"] == PLAN_SCHEMA
    assert set(doc) == {"schema", "workload", "geometry", "selected", "settings", "unavailable", "budget"}
    assert doc["workload"]["name"] == preset and isinstance(doc["workload"]["quant"], dict)
    geometry_keys = {"caches", "chunk_tokens", "sink_tokens", "global_sink_tokens", "effective_sink_tokens",
                     "window_tokens", "cache_size_tokens", "attention_window_tokens", "page_bytes", "dense_row_bytes",
                     "dense_rows_per_page", "dense_tokens_per_page", "dense_cache_bytes_per_layer",
                     "dense_cache_bytes_all_layers"}
    assert set(doc["geometry"]) == geometry_keys
    assert all(_is_int(v) for v in doc["geometry"].values())
    assert doc["selected"] == "off"
    assert [s["mode"] for s in doc["settings"]] == ["off", "int4", "int2"]
    for s in doc["settings"]:
        assert set(s) == {"mode", "exact_by", "per_layer", "all_layers", "segment_pages", "ratio_vs_dense",
                          "pool_pages", "pool_bytes", "transient_view_tokens", "transient_view_bytes",
                          "budget_bytes", "warmup_chunks"}
        assert set(s["per_layer"]) == {"bytes", "pages", "used_bytes", "waste_bytes", "bf16_bytes", "packed_bytes",
                                       "bf16_segments", "packed_segments", "dense_bytes"}
        assert set(s["all_layers"]) == {"bytes", "pages", "used_bytes", "waste_bytes", "dense_bytes"}
        assert all(_is_int(v) for v in [*s["per_layer"].values(), *s["all_layers"].values()])
        assert isinstance(s["ratio_vs_dense"], float)
        assert s["all_layers"]["bytes"] == s["per_layer"]["bytes"] * doc["geometry"]["caches"]
        assert s["budget_bytes"] == s["pool_bytes"] + s["transient_view_bytes"]
        assert s["pool_bytes"] == s["pool_pages"] * doc["geometry"]["page_bytes"]
    budget = doc["budget"]
    assert budget["bytes"] == 40 << 30 and budget["source"] == "--budget"
    assert [f["mode"] for f in budget["fits"]] == ["off", "int4", "int2"]
    for f in budget["fits"]:
        assert set(f) == {"mode", "max_window_frames", "search_limited", "cache_size_tokens", "budget_bytes",
                          "pool_bytes", "min_window_frames", "min_budget_bytes"}
        assert _is_int(f["max_window_frames"]) and f["budget_bytes"] <= budget["bytes"]
    frames = [f["max_window_frames"] for f in budget["fits"]]
    assert frames == sorted(frames)  # int2 fits the most


def test_plan_budget_and_window_roundtrip(capsys) -> None:
    """The largest window for a budget needs at most that budget; the plan at that window says so."""
    code, out, _ = run(capsys, "plan", "--preset", "lingbot-world", "--budget", "24GiB", "--json")
    assert code == 0
    fits = {f["mode"]: f for f in json.loads(out)["budget"]["fits"]}
    frames = fits["int2"]["max_window_frames"]
    _, out, _ = run(capsys, "plan", "--preset", "lingbot-world", "--window-frames", str(frames), "--json")
    needed = {s["mode"]: s["budget_bytes"] for s in json.loads(out)["settings"]}
    assert needed["int2"] == fits["int2"]["budget_bytes"] <= 24 << 30


def test_plan_memory_fraction(capsys) -> None:
    code, out, _ = run(capsys, "plan", "--preset", "self-forcing-mini", "--memory-fraction", "0.5", "--device", "cpu",
                       "--json")
    assert code == 0
    budget = json.loads(out)["budget"]
    assert budget["bytes"] > 0 and "free on cpu" in budget["source"]


def test_plan_quant_flags(capsys) -> None:
    code, out, _ = run(capsys, "plan", "--kv-cache-quant", "int2", "--kv-cache-quant-keep-recent", "2",
                       "--kv-cache-quant-sink", "false", "--kv-cache-quant-centroids", "64", "--json")
    assert code == 0
    doc = json.loads(out)
    q = doc["workload"]["quant"]
    assert (q["bits"], q["keep_recent_chunks"], q["sink"], q["centroids"], q["mode"]) == (2, 2, False, 64, "int2")
    assert doc["selected"] == "int2"
    int2 = next(s for s in doc["settings"] if s["mode"] == "int2")
    # sink kept bf16, current + 2 recent bf16, 3 older window chunks packed
    assert (int2["per_layer"]["bf16_segments"], int2["per_layer"]["packed_segments"]) == (4, 3)


def test_plan_marks_impossible_quant_modes(capsys) -> None:
    code, out, _ = run(capsys, "plan", "--preset", "lingbot-world-mini", "--head-dim", "48")
    assert code == 0
    assert "paged int2: not possible with this shape" in out


def test_parse_size() -> None:
    assert parse_size("24GiB") == 24 << 30
    assert parse_size("1.5 MiB") == 3 << 19
    assert parse_size("2MB") == 2_000_000
    assert parse_size("4096") == 4096
    assert parse_size("2M") == 2 << 20


# ---------------------------------------------------------------------------------------------------- bad input
BAD_INPUTS = {
    "unknown preset": ["plan", "--preset", "nope"],
    "negative layers": ["plan", "--layers", "-3"],
    "zero heads": ["plan", "--heads", "0"],
    "negative sink": ["simulate", "--sink-frames", "-1", "--dry-run"],
    "negative budget": ["plan", "--budget", "-5GiB"],
    "bad size": ["plan", "--budget", "lots"],
    "budget too small": ["plan", "--preset", "lingbot-world", "--budget", "1GiB"],
    "window smaller than a chunk": ["plan", "--window-frames", "2"],
    "cache size smaller than sink + chunk": ["plan", "--cache-size", "5000"],
    "page not a multiple of 256": ["plan", "--page-bytes", "1000"],
    "page smaller than a token": ["plan", "--page-bytes", "4KiB"],
    "bad quant mode": ["plan", "--kv-cache-quant", "int3"],
    "bad centroids": ["plan", "--kv-cache-quant", "int2", "--kv-cache-quant-centroids", "999"],
    "bad boolean": ["plan", "--kv-cache-quant-sink", "maybe"],
    "block size vs head dim": ["plan", "--kv-cache-quant", "int2", "--kv-cache-quant-block-size", "48"],
    "memory fraction out of range": ["plan", "--memory-fraction", "1.5"],
    "budget and fraction together": ["plan", "--budget", "1GiB", "--memory-fraction", "0.5"],
    "no command": [],
    "unknown device": ["simulate", "--device", "tpu", *TINY_SIM],
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_exits_2_with_one_line(capsys, case: str, tmp_path: Path) -> None:
    argv = BAD_INPUTS[case]
    if argv and argv[0] == "simulate":
        argv = [*argv, "--out", str(tmp_path)]
    code, out, err = run(capsys, *argv)
    assert code == 2, (case, out, err)
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("pagedqvg: error: ")
    assert "Traceback" not in err


def test_full_size_real_run_that_does_not_fit_exits_2(capsys, tmp_path: Path, monkeypatch) -> None:
    """A real run that would not fit the device's free memory is refused up front (the hint names --dry-run)."""
    monkeypatch.setattr("pagedqvg.simulate.available_memory_bytes", lambda device: 4 << 30)
    code, _, err = run(capsys, "simulate", "--preset", "lingbot-world", "--no-progress", "--out", str(tmp_path))
    assert code == 2 and len(err.splitlines()) == 1
    assert "--dry-run" in err and "free" in err


def test_bad_input_error_texts(capsys) -> None:
    _, _, err = run(capsys, "plan", "--preset", "lingbot-world", "--budget", "1GiB")
    assert "too small for even the sink" in err
    _, _, err = run(capsys, "plan", "--window-frames", "2")
    assert "window smaller than a chunk" in err
    _, _, err = run(capsys, "plan", "--preset", "nope")
    assert "invalid choice" in err and "lingbot-world" in err


def test_console_script_exit_status() -> None:
    """The real process: one stderr line and status 2 for bad input; help exits 0."""
    script = Path(sys.executable).with_name("pagedqvg")
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "pagedqvg.cli"]
    bad = subprocess.run([*cmd, "plan", "--preset", "nope"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stdout == ""
    assert len(bad.stderr.splitlines()) == 1 and bad.stderr.startswith("pagedqvg: error:")
    ok = subprocess.run([*cmd, "--help"], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and "plan" in ok.stdout and "simulate" in ok.stdout


# ---------------------------------------------------------------------------------------------------- simulate
def _summary_schema(s: dict) -> None:
    assert s["schema"] == SUMMARY_SCHEMA
    assert set(s) == {"schema", "workload", "engine", "device", "quant_requested", "quant_measured", "note", "chunks",
                      "calls", "seconds", "pool_capacity_bytes", "measured", "plan", "agreement", "accounting",
                      "plan_only", "outputs"}
    assert set(s["measured"]) == {"steady_state_bytes", "high_water_bytes", "used_bytes", "waste_bytes",
                                  "bf16_bytes", "packed_bytes", "max_view_bytes"}
    assert all(_is_int(v) for v in s["measured"].values())
    assert set(s["plan"]) == {"mode", "steady_state_bytes", "high_water_bytes", "used_bytes", "waste_bytes",
                              "dense_bf16_bytes", "transient_view_bytes", "warmup_chunks"}
    assert set(s["agreement"]) == {"checked", "steady_state_rel_diff", "high_water_rel_diff", "tolerance", "ok"}


def test_simulate_tiny_writes_json_and_png(capsys, tmp_path: Path) -> None:
    t0 = time.perf_counter()
    code, out, err = run(capsys, "simulate", *TINY_SIM, "--out", str(tmp_path), "--json")
    assert time.perf_counter() - t0 < 20
    assert code == 0, err
    summary = json.loads(out)
    _summary_schema(summary)
    assert summary["engine"] == "caches" and summary["device"] == "cpu"
    assert summary["agreement"] == {"checked": True, "steady_state_rel_diff": 0.0, "high_water_rel_diff": 0.0,
                                    "tolerance": 0.01, "ok": True}
    assert summary["accounting"]["mismatches"] == 0
    assert summary["accounting"]["calls_compared"] == summary["calls"] == 2 * 9 * 3
    assert {p["mode"] for p in summary["plan_only"]} == {"int4", "int2"}
    timeline = json.loads((tmp_path / "timeline.json").read_text())
    assert timeline["fields"] == list(TIMELINE_FIELDS)
    assert len(timeline["records"]) == summary["calls"]
    assert set(timeline["records"][0]) == set(TIMELINE_FIELDS)
    assert timeline["summary"]["measured"] == summary["measured"]
    png = (tmp_path / "timeline.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert summary["outputs"] == {"timeline_json": str(tmp_path / "timeline.json"),
                                  "timeline_png": str(tmp_path / "timeline.png")}


def test_simulate_table_says_where_outputs_went(capsys, tmp_path: Path) -> None:
    code, out, _ = run(capsys, "simulate", *TINY_SIM, "--out", str(tmp_path), "--no-plot")
    assert code == 0
    assert "measured vs plan: agree" in out
    assert f"timeline: {tmp_path / 'timeline.json'}" in out
    assert "calls identical" in out
    assert not (tmp_path / "timeline.png").exists()


def test_simulate_quantized_tiny(capsys, tmp_path: Path) -> None:
    code, out, err = run(capsys, "simulate", *TINY_SIM, "--kv-cache-quant", "int2", "--kv-cache-quant-centroids", "8",
                         "--kv-cache-quant-iters", "1", "--out", str(tmp_path), "--json", "--no-plot")
    assert code == 0, err
    s = json.loads(out)
    assert s["quant_measured"] == "int2" and s["plan"]["mode"] == "int2"
    assert s["measured"]["packed_bytes"] > 0
    assert s["agreement"]["ok"] and s["accounting"]["mismatches"] == 0


@pytest.mark.parametrize("preset", FULL_PRESETS)
def test_dry_run_full_size_is_fast(capsys, tmp_path: Path, preset: str) -> None:
    t0 = time.perf_counter()
    code, out, err = run(capsys, "simulate", "--preset", preset, "--dry-run", "--no-progress", "--no-plot",
                         "--out", str(tmp_path), "--json")
    assert time.perf_counter() - t0 < 30
    assert code == 0, err
    s = json.loads(out)
    _summary_schema(s)
    assert s["engine"] == "accounting" and s["accounting"] is None
    assert s["agreement"]["checked"] and s["agreement"]["ok"]
    assert s["measured"]["steady_state_bytes"] == s["plan"]["steady_state_bytes"]


@pytest.mark.slow
def test_simulate_without_arguments(capsys, tmp_path: Path, monkeypatch) -> None:
    """`pagedqvg simulate` alone: the scaled-down preset on the CPU, outputs in ./pagedqvg-out/."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MPLBACKEND", "Agg")
    code, out, err = run(capsys, "simulate")
    assert code == 0, err
    assert "lingbot-world-mini" in out and "measured vs plan: agree" in out
    assert "timeline: pagedqvg-out/timeline.json" in out and "plot: pagedqvg-out/timeline.png" in out
    assert (tmp_path / "pagedqvg-out" / "timeline.json").exists()
    assert (tmp_path / "pagedqvg-out" / "timeline.png").exists()
    assert os.path.getsize(tmp_path / "pagedqvg-out" / "timeline.png") > 10_000


def test_unwritable_output_folder_exits_2_before_the_run(capsys, tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert main(["simulate", "--dry-run", "--out", str(blocker)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("pagedqvg: error: --out") and "cannot write there" in err[0]
