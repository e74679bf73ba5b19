"""The `pagedqvg` command: plan tables and JSON for every preset, simulate outputs, exit status 2 on bad input."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pagedqvg.cli.app import build_parser, main
from pagedqvg.cli.args import size_arg as _size
from pagedqvg.cli.plan_doc import PLAN_SCHEMA, build_plan
from pagedqvg.errors import PagedQVGError
from pagedqvg.planning.budget import Budget, BudgetError
from pagedqvg.planning.geometry import Geometry
from pagedqvg.planning.planner import plan_geometry
from pagedqvg.planning.presets import PRESETS, get_preset, quant_as_dict
from pagedqvg.planning.simulate import SUMMARY_SCHEMA, TIMELINE_FIELDS
from pagedqvg.quant.config import QuantConfig
from pagedqvg.sizes import SizeError, parse_size

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
    for text in ("dense bf16 (reference)", "paged bf16 *", "paged int4", "paged int2", "paged compact",
                 "transient view", "budget needed", f"pagedqvg plan: {preset}"):
        assert text in out


def test_dense_rows_are_labelled_with_the_cache_dtype(capsys) -> None:
    """Dense (unquantized) rows and segments carry the cache dtype's name in the tables: never bf16 for fp32."""
    code, out, err = run(capsys, "plan", "--preset", "lingbot-world-mini", "--dtype", "fp32", "--budget", "64MiB")
    assert code == 0 and err == ""
    for text in ("fp32 token row 1,024 B", "dense fp32 (reference)", "paged fp32 *", " 7 fp32 ", "2 fp32 + 5 packed",
                 "dense = dense fp32 bytes", "\n    fp32 "):
        assert text.replace("\\n", "\n") in out, text
    assert "bf16" not in out
    code, out, err = run(capsys, "simulate", *TINY_SIM, "--dtype", "fp32", "--dry-run")
    assert code == 0
    assert "fp32 / packed segments" in out and "dense fp32 cache (reference)" in out and "bf16" not in out


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
    geometry_keys = {"caches", "sessions", "cache_sets", "ranks", "heads_per_rank",
                     "chunk_tokens", "sink_tokens", "global_sink_tokens", "effective_sink_tokens",
                     "window_tokens", "cache_size_tokens", "attention_window_tokens", "page_bytes", "dense_row_bytes",
                     "dense_rows_per_page", "dense_tokens_per_page", "dense_cache_bytes_per_layer",
                     "dense_cache_bytes_all_layers"}
    assert set(doc["geometry"]) == geometry_keys
    assert all(_is_int(v) for v in doc["geometry"].values())
    assert doc["selected"] == "off"
    assert [s["mode"] for s in doc["settings"]] == ["off", "int4", "int2", "compact"]
    assert [s["quant"]["mode"] for s in doc["settings"]] == ["off", "int4", "int2", "compact"]
    assert doc["settings"][-1]["quant"] == quant_as_dict(QuantConfig.compact())
    for s in doc["settings"]:
        assert set(s) == {"mode", "quant", "exact_by", "page_bytes", "page_auto", "page_waste_by_kind", "per_layer",
                          "all_layers", "segment_pages", "ratio_vs_dense", "pool_pages", "pool_bytes", "tiers",
                          "transient_view_tokens", "transient_view_bytes", "budget_bytes", "warmup_chunks",
                          "attention"}
        assert s["page_auto"] and s["per_layer"]["waste_bytes"] <= 0.01 * s["per_layer"]["bytes"]
        # per segment kind too, except compact's packed chunks on lingbot-world and self-forcing: no page meets
        # 0.5% for both kinds there, so auto takes the least waste of one segment of each kind together (160 KiB /
        # 48 KiB: bf16 0%, packed 1.39%; 0.33% / 0.38% at steady state, checked above)
        limit = 0.014 if s["mode"] == "compact" else 0.01
        assert all(w <= limit for w in s["page_waste_by_kind"].values()), s["page_waste_by_kind"]
        assert set(s["per_layer"]) == {"bytes", "pages", "used_bytes", "waste_bytes", "bf16_bytes", "packed_bytes",
                                       "bf16_segments", "packed_segments", "dense_bytes"}
        assert set(s["all_layers"]) == {"bytes", "pages", "used_bytes", "waste_bytes", "dense_bytes"}
        assert all(_is_int(v) for v in [*s["per_layer"].values(), *s["all_layers"].values()])
        assert isinstance(s["ratio_vs_dense"], float)
        assert s["all_layers"]["bytes"] == s["per_layer"]["bytes"] * doc["geometry"]["caches"]
        assert s["budget_bytes"] == s["pool_bytes"] + s["transient_view_bytes"]
        assert s["pool_bytes"] == s["pool_pages"] * s["page_bytes"]
    assert doc["geometry"]["page_bytes"] == doc["settings"][0]["page_bytes"]  # the selected setting's (off)
    budget = doc["budget"]
    assert budget["bytes"] == 40 << 30 and budget["source"] == "--budget"
    assert [f["mode"] for f in budget["fits"]] == ["off", "int4", "int2", "compact"]
    for f in budget["fits"]:
        assert set(f) == {"mode", "page_bytes", "max_window_frames", "search_limited", "cache_size_tokens",
                          "budget_bytes", "pool_bytes", "min_window_frames", "min_budget_bytes", "max_sessions",
                          "by_attention"}
        assert _is_int(f["max_window_frames"]) and f["budget_bytes"] <= budget["bytes"]
    frames = [f["max_window_frames"] for f in budget["fits"]]
    assert frames == sorted(frames) and frames[2] < frames[3]  # compact fits the most


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
    assert budget["bytes"] > 0 and "free memory on cpu" in budget["source"]


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
    code, out, _ = run(capsys, "plan", "--preset", "lingbot-world", "--head-dim", "192")
    assert code == 0
    assert "paged compact: not possible with this shape: --kv-cache-quant-block-size 128 does not divide " \
           "--head-dim 192" in out


def _plan_json(capsys, *argv: str) -> dict:
    code, out, err = run(capsys, "plan", *argv, "--json")
    assert code == 0, err
    return json.loads(out)


def test_plan_compact_from_the_command_line(capsys) -> None:
    """--kv-cache-quant compact: compact's format fields (block 128, not the preset's 64), the typed flags on top."""
    doc = _plan_json(capsys, "--kv-cache-quant", "compact")
    assert doc["selected"] == "compact"
    assert doc["workload"]["quant"] == quant_as_dict(QuantConfig.compact())
    assert doc["settings"][-1]["quant"] == doc["workload"]["quant"]
    # next to compact, int4 and int2 are the reference formats
    assert doc["settings"][1]["quant"] == quant_as_dict(QuantConfig(bits=4))
    assert doc["settings"][2]["quant"] == quant_as_dict(QuantConfig(bits=2))
    doc = _plan_json(capsys, "--kv-cache-quant", "compact", "--kv-cache-quant-keep-recent", "0",
                     "--kv-cache-quant-centroids", "64", "--kv-cache-quant-block-size", "64",
                     "--kv-cache-quant-fit-scales", "--kv-cache-quant-pack-trits", "true")
    assert doc["workload"]["quant"] == quant_as_dict(QuantConfig.compact(keep_recent_chunks=0, centroids=64,
                                                                         block_size=64))
    compact = doc["settings"][-1]
    assert compact["mode"] == "compact" and compact["per_layer"]["bf16_segments"] == 1  # only the current chunk
    # the same flags by hand make the same mode
    by_hand = _plan_json(capsys, "--kv-cache-quant", "int2", "--kv-cache-quant-pack-trits",
                         "--kv-cache-quant-fit-scales", "--kv-cache-quant-codebook-fp8", "--kv-cache-quant-block-size",
                         "128")
    assert by_hand["selected"] == "compact" and by_hand["workload"]["quant"] == quant_as_dict(QuantConfig.compact())


def test_plan_compact_takes_the_presets_policy_not_its_format(capsys, monkeypatch) -> None:
    """A preset with its own quant settings: compact keeps its keep-recent/sink/sink-keep/seed, not its block size
    or centroids; a typed flag still wins."""
    policy = dict(keep_recent_chunks=2, sink=False, sink_keep_chunks=1, seed=9)
    preset = PRESETS["lingbot-world"]
    monkeypatch.setitem(PRESETS, "lingbot-world", dataclasses.replace(
        preset, quant=QuantConfig(bits=2, block_size=32, centroids=16, stages=2, **policy)))
    doc = _plan_json(capsys, "--kv-cache-quant", "compact")
    assert doc["workload"]["quant"] == quant_as_dict(QuantConfig.compact(**policy))
    doc = _plan_json(capsys, "--kv-cache-quant", "compact", "--kv-cache-quant-seed", "3")
    assert doc["workload"]["quant"] == quant_as_dict(QuantConfig.compact(**{**policy, "seed": 3}))
    # without compact selected, the compact row still takes the preset's policy
    doc = _plan_json(capsys)
    assert doc["settings"][-1]["quant"] == quant_as_dict(QuantConfig.compact(**policy))
    assert doc["settings"][2]["quant"]["block_size"] == 32  # int2 keeps the preset's knobs, as before


def test_plan_compact_below_128_channels(capsys) -> None:
    """head_dim 64 (the minis): one fitted scale per token-head (block 64), said under the table; a typed block
    that does not divide head_dim is refused."""
    doc = _plan_json(capsys, "--preset", "lingbot-world-mini", "--kv-cache-quant", "compact")
    assert doc["workload"]["quant"] == quant_as_dict(QuantConfig.compact(block_size=64))
    code, out, _ = run(capsys, "plan", "--preset", "lingbot-world-mini")
    assert code == 0 and "paged compact" in out
    assert "paged compact: blocks of 64 channels per fitted scale (head_dim below 128" in out
    _, out, _ = run(capsys, "plan", "--preset", "lingbot-world")
    assert "blocks of" not in out


def test_plan_new_quant_flags(capsys) -> None:
    doc = _plan_json(capsys, "--kv-cache-quant", "int4", "--kv-cache-quant-fit-scales", "--kv-cache-quant-codebook-fp8",
                     "yes")
    q = doc["workload"]["quant"]
    assert (q["bits"], q["fit_scales"], q["codebook_fp8"], q["pack_trits"], q["mode"]) == (4, True, True, False, "int4")
    assert doc["settings"][1]["quant"] == q  # the int4 row is the selected config


def test_plan_budget_lines_show_compact(capsys) -> None:
    code, out, _ = run(capsys, "plan", "--preset", "lingbot-world", "--budget", "24GiB")
    assert code == 0
    lines = {line.split()[0]: line for line in out.splitlines() if line.startswith("    ") and "frames" in line}
    assert set(lines) == {"bf16", "int4", "int2", "compact"}
    frames = {k: int(v.split()[1]) for k, v in lines.items()}
    assert frames["compact"] > frames["int2"] > frames["int4"] > frames["bf16"]
    assert "session(s) at 18 frames" in lines["compact"]


def test_plan_help_does_not_offer_chunks(capsys) -> None:
    assert main(["plan", "--help"]) == 0
    assert "--chunks" not in capsys.readouterr().out
    assert main(["simulate", "--help"]) == 0
    assert "--chunks" in capsys.readouterr().out


def test_version(capsys) -> None:
    import pagedqvg

    code, out, err = run(capsys, "--version")
    assert code == 0 and out.strip() == f"pagedqvg {pagedqvg.__version__}" and err == ""


def test_budget_rules_agree_and_say_how_to_write_it(capsys) -> None:
    """`--budget -5GiB` (argparse would take -5GiB for a flag), `--budget=-5GiB` and `--budget 0` get one rule."""
    errs = []
    for argv in (["--budget", "-5GiB"], ["--budget=-5GiB"], ["--budget", "0"]):
        code, _, err = run(capsys, "plan", *argv)
        assert code == 2
        errs.append(err)
    for err in errs:
        assert "--budget" in err and "must be a size > 0 bytes" in err and "write it like --budget 24GiB" in err
    assert errs[0] == errs[1]


@pytest.mark.parametrize(
    ("argv", "flags", "internal"),
    [
        (["--kv-cache-quant", "int2", "--kv-cache-quant-centroids", "999"], ["--kv-cache-quant-centroids 999"],
         ["QuantConfig", "centroids="]),
        (["--kv-cache-quant", "int2", "--kv-cache-quant-block-size", "48"],
         ["--kv-cache-quant-block-size 48", "--head-dim 128"], ["block_size", "head_dim"]),
        (["--kv-cache-quant", "int4", "--kv-cache-quant-pack-trits"],
         ["--kv-cache-quant-pack-trits true", "--kv-cache-quant int4"], ["pack_trits", "bits="]),
        (["--kv-cache-quant", "off", "--kv-cache-quant-stages", "2"],
         ["--kv-cache-quant-stages", "--kv-cache-quant off"], []),
        (["--chunks", "5"], ["--chunks", "simulate"], []),
        (["--ulysses", "3"], ["--ulysses 3", "--heads 40", "1, 2, 4, 5, 8, 10, 20, 40"], []),
        (["--page-bytes", "1000"], ["--page-bytes", "1024"], ["page_bytes"]),
        (["--layers", "0"], ["--layers"], []),
        (["--kv-cache-quant", "off", "--kv-cache-quant-fit-scales"],
         ["--kv-cache-quant-fit-scales", "--kv-cache-quant off", "compact"], []),
        (["--kv-cache-quant", "off", "--kv-cache-quant-codebook-fp8", "false"],
         ["--kv-cache-quant-codebook-fp8", "--kv-cache-quant off"], []),
        (["--kv-cache-quant", "compact", "--kv-cache-quant-pack-trits", "false"],
         ["--kv-cache-quant compact", "--kv-cache-quant-pack-trits false", "--kv-cache-quant int2"], ["pack_trits"]),
        (["--kv-cache-quant", "compact", "--kv-cache-quant-fit-scales=no"],
         ["--kv-cache-quant compact", "--kv-cache-quant-fit-scales false"], ["fit_scales"]),
        (["--kv-cache-quant", "compact", "--kv-cache-quant-codebook-fp8", "0"],
         ["--kv-cache-quant compact", "--kv-cache-quant-codebook-fp8 false"], ["codebook_fp8"]),
        (["--kv-cache-quant", "compact", "--kv-cache-quant-asymmetric"],
         ["--kv-cache-quant compact", "--kv-cache-quant-asymmetric true"], ["asymmetric="]),
        (["--kv-cache-quant", "compact", "--kv-cache-quant-fit-scales", "maybe"],
         ["--kv-cache-quant-fit-scales", "'maybe'", "true"], ["fit_scales"]),
        (["--kv-cache-quant", "int2", "--kv-cache-quant-asymmetric", "--kv-cache-quant-fit-scales"],
         ["--kv-cache-quant-fit-scales true", "--kv-cache-quant-asymmetric true"], ["QuantConfig", "fit_scales"]),
        (["--kv-cache-quant", "compact", "--head-dim", "192"],
         ["--kv-cache-quant compact", "--head-dim 192", "128", "--kv-cache-quant-block-size", "64, 96"], []),
        (["--preset", "lingbot-world-mini", "--kv-cache-quant", "compact", "--kv-cache-quant-block-size", "128"],
         ["--kv-cache-quant-block-size 128", "--head-dim 64"], ["block_size", "head_dim="]),
        (["--kv-cache-quant", "compact", "--kv-cache-quant-centroids", "300"],
         ["--kv-cache-quant-centroids 300", "256"], ["centroids="]),
    ],
)
def test_errors_name_the_flags_typed(capsys, argv: list[str], flags: list[str], internal: list[str]) -> None:
    code, _, err = run(capsys, "plan", *argv)
    assert code == 2 and len(err.splitlines()) == 1
    for text in flags:
        assert text in err, err
    for text in internal:
        assert text not in err, err


def test_simulate_device_errors_name_the_flag(capsys, tmp_path: Path) -> None:
    code, _, err = run(capsys, "simulate", *TINY_SIM, "--device", "tpu", "--out", str(tmp_path))
    assert code == 2 and "--device tpu" in err and "cpu or cuda" in err


def test_plan_header_reflects_overrides(capsys) -> None:
    _, out, _ = run(capsys, "plan", "--preset", "lingbot-world")
    assert out.splitlines()[0].endswith("3-frame chunks, 3-frame global sink, 18-frame window")
    _, out, _ = run(capsys, "plan", "--preset", "lingbot-world", "--sink-frames", "6", "--window-frames", "24",
                    "--chunk-frames", "6")
    assert out.splitlines()[0].endswith("6-frame chunks, 6-frame global sink, 24-frame window")
    assert "3-frame" not in out.splitlines()[0]
    _, out, _ = run(capsys, "plan", "--preset", "lingbot-world", "--sink-frames", "0")
    assert out.splitlines()[0].endswith("3-frame chunks, no sink, 18-frame window")


def test_plan_gpu_budget_arithmetic(capsys) -> None:
    """--gpu: total x fraction - weights / tp - reserve, line by line; the preset's weights by default."""
    code, out, _ = run(capsys, "plan", "--preset", "lingbot-world", "--gpu", "h200", "--tp", "2", "--reserve",
                       "8GiB", "--json")
    assert code == 0
    b = json.loads(out)["budget"]
    total = 143771 << 20
    usable = int(total * 0.9)
    weights = 28_000_000_000
    assert (b["gpu"], b["device_bytes"], b["memory_fraction"]) == ("H200", total, 0.9)
    assert b["weights_bytes"] == weights and b["weights_per_rank_bytes"] == weights // 2
    assert "Wan" in b["weights_source"] and "model card" in b["weights_source"]
    assert b["bytes"] == usable - weights // 2 - (8 << 30)
    assert [line["bytes"] for line in b["lines"]] == [total, usable, weights // 2, 8 << 30, b["bytes"]]
    assert [line["op"] for line in b["lines"]] == ["", "=", "-", "-", "="]
    for f in b["fits"]:
        assert f["budget_bytes"] <= b["bytes"] and f["max_sessions"] >= 1
    code, out, _ = run(capsys, "plan", "--preset", "lingbot-world", "--gpu", "H200", "--tp", "2", "--reserve", "8GiB")
    assert "budget per rank:" in out and "weights / --tp 2" in out and "(--reserve)" in out
    assert "KV budget per rank" in out and "session(s) at 18 frames" in out
    code, out, _ = run(capsys, "plan", "--gpu", "H100", "--memory-fraction", "0.5", "--weights", "10GB", "--json")
    b = json.loads(out)["budget"]
    assert b["bytes"] == int((81559 << 20) * 0.5) - 10_000_000_000 and b["weights_source"] == "--weights"


def test_plan_sessions_and_ranks(capsys) -> None:
    """Sessions multiply the caches in the pool; ranks divide the heads; max_sessions agrees with a plan at N."""
    _, out, _ = run(capsys, "plan", "--preset", "self-forcing", "--budget", "24GiB", "--json", "--ulysses", "2",
                    "--sessions", "3", "--cache-sets", "2")
    doc = json.loads(out)
    g = doc["geometry"]
    assert (g["ranks"], g["heads_per_rank"], g["sessions"], g["caches"]) == (2, 6, 3, 30 * 2 * 3)
    for f in doc["budget"]["fits"]:
        n = f["max_sessions"]
        args = ["plan", "--preset", "self-forcing", "--ulysses", "2", "--cache-sets", "2", "--json",
                "--kv-cache-quant", "off" if f["mode"] == "off" else f["mode"]]
        _, out, _ = run(capsys, *args, "--sessions", str(n))
        needed = next(s for s in json.loads(out)["settings"] if s["mode"] == f["mode"])["budget_bytes"]
        assert needed <= 24 << 30
        _, out, _ = run(capsys, *args, "--sessions", str(n + 1))
        needed = next(s for s in json.loads(out)["settings"] if s["mode"] == f["mode"])["budget_bytes"]
        assert needed > 24 << 30


def test_parse_size() -> None:
    """The argparse type of the size flags (--budget, --page-bytes, --weights, --reserve)."""
    parse_size, page_bytes = _size("--budget"), _size("--page-bytes", example="2MiB", auto=True)
    assert parse_size("24GiB") == 24 << 30
    assert parse_size("1.5 MiB") == 3 << 19
    assert parse_size("2MB") == 2_000_000
    assert parse_size("4096") == 4096
    assert parse_size("2M") == 2 << 20
    assert page_bytes(" Auto ") == "auto" and page_bytes("64KiB") == 64 << 10
    assert _size("--reserve", minimum=0)("0") == 0


# ---------------------------------------------------------------------------------------------------- bad input
BAD_INPUTS = {
    "unknown preset": ["plan", "--preset", "nope"],
    "negative layers": ["plan", "--layers", "-3"],
    "zero heads": ["plan", "--heads", "0"],
    "negative sink": ["simulate", "--sink-frames", "-1", "--dry-run"],
    "negative budget": ["plan", "--budget", "-5GiB"],
    "negative budget joined": ["plan", "--budget=-5GiB"],
    "zero budget": ["plan", "--budget", "0"],
    "negative weights": ["plan", "--gpu", "H100", "--weights", "-1GB"],
    "quant off with a quant knob": ["plan", "--kv-cache-quant", "off", "--kv-cache-quant-pack-trits"],
    "trits with int4": ["plan", "--kv-cache-quant", "int4", "--kv-cache-quant-pack-trits"],
    "plan --chunks": ["plan", "--chunks", "5"],
    "unknown gpu": ["plan", "--gpu", "B300"],
    "weights larger than the gpu": ["plan", "--gpu", "A100-40GB", "--weights", "60GB"],
    "gpu too small for the smallest window": ["plan", "--gpu", "L4", "--weights", "1GB", "--reserve", "19GiB"],
    "ulysses not dividing heads": ["plan", "--ulysses", "3"],
    "tp x ulysses not dividing heads": ["plan", "--ulysses", "2", "--tp", "3"],
    "weights without a device": ["plan", "--weights", "1GB"],
    "budget and gpu": ["plan", "--budget", "1GiB", "--gpu", "H100"],
    "gpu and device": ["plan", "--gpu", "H100", "--device", "cpu"],
    "device without fraction": ["plan", "--device", "cpu"],
    "sink tokens and frames": ["plan", "--sink-frames", "6", "--sink-tokens", "100"],
    "cache size and window": ["plan", "--cache-size", "50000", "--window-frames", "20"],
    "zero sessions": ["plan", "--sessions", "0"],
    "dry run with device": ["simulate", "--dry-run", "--device", "cpu"],
    "dry run with seed": ["simulate", "--dry-run", "--seed", "3"],
    "bad page bytes word": ["plan", "--page-bytes", "big"],
    "bad size": ["plan", "--budget", "lots"],
    "budget too small": ["plan", "--preset", "lingbot-world", "--budget", "1GiB"],
    "window smaller than a chunk": ["plan", "--window-frames", "2"],
    "cache size smaller than sink + chunk": ["plan", "--cache-size", "5000"],
    "page not a multiple of 256": ["plan", "--page-bytes", "1000"],
    "page smaller than a token": ["plan", "--page-bytes", "4KiB"],
    "bad quant mode": ["plan", "--kv-cache-quant", "int3"],
    "compact without trits": ["plan", "--kv-cache-quant", "compact", "--kv-cache-quant-pack-trits", "false"],
    "compact asymmetric": ["simulate", "--kv-cache-quant", "compact", "--kv-cache-quant-asymmetric", "--dry-run"],
    "compact head dim 192": ["simulate", "--kv-cache-quant", "compact", "--head-dim", "192", "--dry-run"],
    "fit scales with quant off": ["simulate", "--kv-cache-quant", "off", "--kv-cache-quant-fit-scales", "--dry-run"],
    "bad fp8 codebook boolean": ["plan", "--kv-cache-quant-codebook-fp8", "perhaps"],
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
    monkeypatch.setattr("pagedqvg.planning.simulate.available_memory_bytes", lambda device: 4 << 30)
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


def test_reader_that_leaves_early_gets_no_traceback(monkeypatch, tmp_path: Path) -> None:
    """`pagedqvg plan | head -1`: the pipe closes under print(); exit status 1, nothing raised."""

    class ClosedPipe:
        def __init__(self) -> None:
            self.file = open(tmp_path / "out", "w")  # noqa: SIM115 (a real fd for os.dup2)

        def write(self, text: str) -> int:
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self) -> None:
            pass

        def fileno(self) -> int:
            return self.file.fileno()

    pipe = ClosedPipe()
    monkeypatch.setattr(sys, "stdout", pipe)
    try:
        assert main(["plan", "--preset", "self-forcing-mini"]) == 1
    finally:
        pipe.file.close()


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
    assert set(s) == {"schema", "workload", "engine", "device", "quant_requested", "quant_measured", "chunks",
                      "calls", "seconds", "pool_capacity_bytes", "measured", "plan", "agreement", "accounting",
                      "plan_only", "outputs"}
    assert set(s["measured"]) == {"steady_state_bytes", "high_water_bytes", "used_bytes", "waste_bytes",
                                  "bf16_bytes", "packed_bytes", "max_view_bytes"}
    assert all(_is_int(v) for v in s["measured"].values())
    assert set(s["plan"]) == {"mode", "steady_state_bytes", "high_water_bytes", "used_bytes", "waste_bytes",
                              "dense_bf16_bytes", "transient_view_bytes", "warmup_chunks"}
    assert set(s["agreement"]) == {"checked", "steady_state_rel_diff", "high_water_rel_diff", "tolerance", "ok"}


def test_simulate_tiny_writes_json_and_png(capsys, tmp_path: Path) -> None:
    code, out, err = run(capsys, "simulate", *TINY_SIM, "--out", str(tmp_path), "--json")
    assert code == 0, err
    summary = json.loads(out)
    _summary_schema(summary)
    assert summary["engine"] == "caches" and summary["device"] == "cpu"
    assert summary["agreement"] == {"checked": True, "steady_state_rel_diff": 0.0, "high_water_rel_diff": 0.0,
                                    "tolerance": 0.01, "ok": True}
    assert summary["accounting"]["mismatches"] == 0
    assert summary["accounting"]["calls_compared"] == summary["calls"] == 2 * 9 * 3
    assert [p["mode"] for p in summary["plan_only"]] == ["int4", "int2", "compact"]
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


def test_simulate_sessions_and_ranks_tiny(capsys, tmp_path: Path) -> None:
    """Two sessions x two CFG sets of one Ulysses rank (of two) in one pool, int2: plan == measured, call by call."""
    argv = list(TINY_SIM)
    argv[argv.index("--heads") + 1] = "4"
    code, out, err = run(capsys, "simulate", *argv, "--ulysses", "2", "--sessions", "2",
                         "--cache-sets", "2", "--kv-cache-quant", "int2", "--kv-cache-quant-centroids", "8",
                         "--kv-cache-quant-iters", "1", "--out", str(tmp_path), "--json", "--no-plot")
    assert code == 0, err
    s = json.loads(out)
    assert s["agreement"]["ok"] and s["agreement"]["steady_state_rel_diff"] == 0.0
    assert s["accounting"]["mismatches"] == 0 and s["calls"] == 2 * 2 * 2 * 9 * 3
    assert s["measured"]["packed_bytes"] > 0
    records = json.loads((tmp_path / "timeline.json").read_text())["records"]
    assert len({r["cache"] for r in records}) == 8


def test_dry_run_table_does_not_say_measured(capsys, tmp_path: Path) -> None:
    code, out, _ = run(capsys, "simulate", "--dry-run", "--no-plot", "--no-progress", "--out", str(tmp_path))
    assert code == 0
    assert "measured" not in out and "replayed vs plan: agree" in out


def test_simulate_quantized_tiny(capsys, tmp_path: Path) -> None:
    code, out, err = run(capsys, "simulate", *TINY_SIM, "--kv-cache-quant", "int2", "--kv-cache-quant-centroids", "8",
                         "--kv-cache-quant-iters", "1", "--out", str(tmp_path), "--json", "--no-plot")
    assert code == 0, err
    s = json.loads(out)
    assert s["quant_measured"] == "int2" and s["plan"]["mode"] == "int2"
    assert s["measured"]["packed_bytes"] > 0
    assert s["agreement"]["ok"] and s["accounting"]["mismatches"] == 0


def test_simulate_compact_tiny(capsys, tmp_path: Path) -> None:
    """`simulate --kv-cache-quant compact` (head_dim 128: compact's 128-channel blocks) with real caches: the
    compact format in pool pages, plan == measured call by call."""
    code, out, err = run(capsys, "simulate", *TINY_SIM, "--head-dim", "128", "--kv-cache-quant", "compact",
                         "--kv-cache-quant-centroids", "8", "--kv-cache-quant-iters", "1", "--out", str(tmp_path),
                         "--json", "--no-plot")
    assert code == 0, err
    s = json.loads(out)
    assert s["workload"]["quant"] == quant_as_dict(QuantConfig.compact(centroids=8, kmeans_iters=1))
    assert s["quant_requested"] == s["quant_measured"] == s["plan"]["mode"] == "compact"
    assert s["measured"]["packed_bytes"] > 0
    assert s["agreement"]["ok"] and s["agreement"]["steady_state_rel_diff"] == 0.0
    assert s["agreement"]["high_water_rel_diff"] == 0.0
    assert s["accounting"]["mismatches"] == 0 and s["accounting"]["calls_compared"] == s["calls"] == 2 * 9 * 3
    assert s["plan_only"] == []
    code, out, err = run(capsys, "simulate", *TINY_SIM, "--kv-cache-quant", "compact", "--kv-cache-quant-centroids",
                         "8", "--kv-cache-quant-iters", "1", "--out", str(tmp_path), "--no-plot")
    assert code == 0, err  # head_dim 64: one fitted scale per token-head
    assert "quant compact" in out and "measured vs plan: agree" in out and "54/54 calls identical" in out


@pytest.mark.parametrize("preset", FULL_PRESETS)
def test_dry_run_full_size_is_fast(capsys, tmp_path: Path, preset: str) -> None:
    code, out, err = run(capsys, "simulate", "--preset", preset, "--dry-run", "--no-progress", "--no-plot",
                         "--out", str(tmp_path), "--json")
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


# ---------------------------------------------------------------------------------------------------- issue 27
@pytest.mark.parametrize("knob", [["--kv-cache-quant-recent", "fp8"], ["--kv-cache-quant-keep-recent", "2"],
                                  ["--kv-cache-quant-sink", "int4"], ["--kv-cache-quant-centroids", "16"]])
def test_quant_knobs_are_refused_when_quantization_is_off_by_default(capsys, knob: list[str]) -> None:
    """The same refusal whether off is typed or the preset's default (before: accepted silently when unset)."""
    code, out, err = run(capsys, "plan", *knob)
    assert code == 2 and out == "" and len(err.splitlines()) == 1
    assert f"{knob[0]} has no effect with quantization off (--preset lingbot-world's default)" in err
    assert "--kv-cache-quant int2, int4 or compact" in err
    code, _, explicit = run(capsys, "plan", "--kv-cache-quant", "off", *knob)
    assert code == 2 and f"{knob[0]} has no effect with --kv-cache-quant off" in explicit
    code, out, err = run(capsys, "plan", "--kv-cache-quant", "int4", *knob)
    assert code == 0 and err == "" and "paged int4" in out


@pytest.mark.parametrize("text", ["1TiB", "2GiB", "1073742080"])
def test_absurd_page_sizes_are_refused_with_the_range(capsys, text: str) -> None:
    code, out, err = run(capsys, "plan", "--page-bytes", text)
    assert code == 2 and out == "" and len(err.splitlines()) == 1
    assert "--page-bytes" in err and "a multiple of 256 B from 256 B to 1 GiB (or auto)" in err
    code, out, err = run(capsys, "plan", "--preset", "lingbot-world-mini", "--page-bytes", "1GiB")
    assert code == 0 and "1.00 GiB" in out


def test_page_bytes_help_states_the_bound(capsys) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["plan", "--help"])
    assert "from 256 B to 1 GiB" in " ".join(capsys.readouterr().out.split())


def test_a_billion_frame_window_answers_or_refuses(capsys) -> None:
    code, out, err = run(capsys, "plan", "--window-frames", "1000000000", "--json")
    assert code == 0 and err == ""
    doc = json.loads(out)
    assert doc["geometry"]["window_tokens"] == 10**9 * doc["workload"]["tokens_per_frame"]
    for s in doc["settings"]:
        assert s["exact_by"] == "closed form" and sum(s["tiers"]["bytes_per_layer"].values()) == \
            s["per_layer"]["used_bytes"]
    for extra in (["--kv-cache-quant", "int4", "--kv-cache-quant-recent", "fp8"], ["--scene-cut-every", "4"],
                  ["--sessions", "2", "--stagger", "2"]):
        code, out, err = run(capsys, "plan", "--window-frames", "1000000000", *extra)
        assert code == 2 and out == "" and "use --window-frames <= 12285" in err, err


def test_stagger_honours_the_budget(capsys) -> None:
    args = ["plan", "--preset", "lingbot-world-mini", "--sessions", "3", "--stagger", "2"]
    code, out, _ = run(capsys, *args, "--json")
    assert code == 0 and "budget" not in json.loads(out)
    peak = json.loads(out)["peak_bytes"]
    transient = plan_geometry(Geometry.from_workload(get_preset("lingbot-world-mini"))).view_bytes
    for budget, fits in ((peak + transient, True), (peak + transient - 1, False)):
        code, out, _ = run(capsys, *args, "--budget", str(budget), "--json")
        b = json.loads(out)["budget"]
        assert code == 0 and (b["bytes"], b["needed_bytes"], b["fits"]) == (budget, peak + transient, fits)
        assert b["transient_bytes"] == transient and b["source"] == "--budget"
        code, out, _ = run(capsys, *args, "--budget", str(budget))
        assert ("does NOT fit (over by 1 B)" in out) == (not fits) and (": fits" in out) == fits
    code, out, _ = run(capsys, *args, "--gpu", "H200", "--json")
    assert json.loads(out)["budget"]["source"] == "--gpu H200" and json.loads(out)["budget"]["fits"] is True


SIZE_TEXTS = ["24GiB", "1.5 GiB", "2M", "512MB", "4096", "1.1GB", "0.5K", "0.3K", "1e3", "10XB", "1,000", "GiB",
              "2 TiB", "7b", ".5KiB"]


@pytest.mark.parametrize("text", SIZE_TEXTS)
def test_cli_sizes_are_pagedqvg_sizes(capsys, text: str) -> None:
    """--budget accepts exactly the strings `pagedqvg.sizes.parse_size` (the plugin's parser) accepts, as the same
    bytes."""
    try:
        want = parse_size(text, minimum=1)
    except SizeError:
        want = None
    code, out, err = run(capsys, "plan", "--preset", "lingbot-world-mini", "--budget", text, "--json")
    if want is None:
        assert code == 2 and "--budget" in err
    elif code == 0:
        assert json.loads(out)["budget"]["bytes"] == want
    else:  # accepted, but too small for even one chunk: refused by the budget check, naming the bytes
        assert "too small" in err


def test_budget_settings_are_typed_and_shared(capsys) -> None:
    w = get_preset("lingbot-world")
    assert Budget.parse("24GiB").resolve(w).bytes == 24 << 30 == Budget(bytes=24 << 30).resolve(w).bytes
    gpu = Budget(gpu="H200", reserve=8 << 30).resolve(w)
    code, out, _ = run(capsys, "plan", "--gpu", "H200", "--reserve", "8GiB", "--json")
    assert code == 0 and json.loads(out)["budget"] == {**gpu.as_dict(), "fits": json.loads(out)["budget"]["fits"]}
    assert build_plan(w, Budget(gpu="H200", reserve=8 << 30)) == json.loads(out)
    assert gpu.bytes == gpu.lines[1]["bytes"] - gpu.details["weights_per_rank_bytes"] - (8 << 30)
    for kwargs, words in (
        ({"bytes": 1 << 30, "gpu": "H200"}, "bytes is the KV budget itself"),
        ({}, "needs bytes, gpu"),
        ({"memory_fraction": 1.5}, "memory_fraction=1.5"),
        ({"bytes": 0}, "Budget.bytes=0"),
        ({"gpu": "H200", "device": "cpu"}, "drop device"),
        ({"gpu": "H200", "weights": -1}, "Budget.weights=-1"),
    ):
        with pytest.raises(BudgetError, match=words):
            Budget(**kwargs)
    with pytest.raises(BudgetError, match="leaves nothing for the KV cache"):
        Budget(gpu="L4", weights=40 << 30).resolve(w)
    assert issubclass(BudgetError, ValueError) and issubclass(BudgetError, PagedQVGError)


def test_simulate_refuses_a_billion_frame_window(capsys, tmp_path: Path) -> None:
    for extra in (["--dry-run"], []):
        code, out, err = run(capsys, "simulate", "--window-frames", "1000000000", "--chunks", "5", "--no-plot",
                             "--no-progress", "--out", str(tmp_path), *extra)
        assert code == 2 and out == "" and len(err.splitlines()) == 1
        assert ("use --window-frames <= " in err) if extra else ("use --dry-run" in err)
