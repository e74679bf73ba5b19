"""Sessions per device with a host tier (pagedqvg/planning/host_budget.py): the planned resident and parked counts and
the pages a swap moves equal a measured run (real caches, `SessionManager.swap_out` / `swap_in`), quant off and the
recommended tiers; bad values are typed errors; the CLI's plan and simulate."""

from __future__ import annotations

import dataclasses
import json

import pytest

from pagedqvg import QuantConfig
from pagedqvg.cli.app import main
from pagedqvg.cli.fork_sim import measure_host, session_spec
from pagedqvg.errors import CacheConfigError
from pagedqvg.planning.host_budget import host_report, parked_session_pages, resident_session_pages
from pagedqvg.planning.planner import compact_quant
from pagedqvg.serving.sessions import SessionSpec, _geometry, planned_session_pages

TIERS = compact_quant(QuantConfig(), 32, sink_format="int4", recent_format="int4")
PAGE = 16384


def geometry(quant=None):
    spec = SessionSpec(layers=2, batch_size=1, cache_size=240, num_heads=4, head_dim=32, chunk_tokens=48,
                       sink_tokens=48, global_sink_tokens=48, denoise_steps=2, quant=quant)  # fmt: skip
    return _geometry(spec, PAGE)


@pytest.mark.parametrize("quant", [None, TIERS], ids=["off", "tiers"])
def test_planned_sessions_equal_a_measured_run(quant):
    geom = geometry(quant)
    resident = resident_session_pages(geom)
    parked = parked_session_pages(geom)
    assert resident == planned_session_pages(session_spec(geom), PAGE)  # what SessionManager admits by
    pool_pages = 3 * resident + resident // 2
    host_bytes = (2 * parked + 1) * PAGE
    doc = measure_host(geom, pool_pages, host_bytes)
    assert doc["mismatches"] == 0, doc["mismatch_text"]
    m = doc["measured"]
    assert (doc["resident_sessions"], doc["parked_sessions"]) == (3, 2) == (m["resident_sessions"],
                                                                            m["parked_sessions"])  # fmt: skip
    assert m["swap_out_pages"] == m["swap_in_pages"] == parked and m["views_equal_after_swap"]
    assert m["pages_left"] == 0
    assert doc["open_sessions"] == 5 and doc["without_host_tier"] == 3 and doc["rotating_sessions"] == 4


def test_no_room_on_the_host_or_the_device():
    geom = geometry()
    doc = measure_host(geom, resident_session_pages(geom) - 1, PAGE)
    assert doc["mismatches"] == 0 and doc["resident_sessions"] == doc["parked_sessions"] == 0
    doc = measure_host(geom, resident_session_pages(geom), PAGE)  # one resident, a host too small for any
    assert doc["mismatches"] == 0 and (doc["resident_sessions"], doc["parked_sessions"]) == (1, 0)


@pytest.mark.parametrize(
    ("pool", "host", "needle"),
    [
        (-1, 1 << 20, "device pool pages must be an int >= 0, got -1"),
        (10, 0, "--host-budget must be a size >= 1 bytes, got 0"),
        (10, "1GiB", "--host-budget must be a size >= 1 bytes, got '1GiB'"),
        (2.5, 1 << 20, "got 2.5"),
    ],
)
def test_bad_values_are_typed_errors(pool, host, needle):
    with pytest.raises(CacheConfigError, match=needle.replace(".", r"\.")):
        host_report(geometry(), pool, host)


def test_pins_and_several_sessions_are_refused():
    with pytest.raises(CacheConfigError, match="--scene-cut-every 2"):
        host_report(dataclasses.replace(geometry(), scene_cut_every=2), 10, 1 << 20)
    with pytest.raises(CacheConfigError, match="--sessions 2"):
        host_report(dataclasses.replace(geometry(), sessions=2), 10, 1 << 20)


SMALL = ["--preset", "lingbot-world-mini", "--layers", "2", "--heads", "2", "--head-dim", "32", "--tokens-per-frame",
         "16", "--chunk-frames", "2", "--sink-frames", "2", "--window-frames", "6", "--denoise-steps", "2",
         "--page-bytes", "16KiB"]  # fmt: skip


def test_cli_plan_and_simulate_host_budget(capsys, tmp_path):
    assert main(["plan", *SMALL, "--host-budget", "2MiB", "--budget", "2MiB", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["schema"] == "pagedqvg.forks/1" and doc["host_pages"] == 128 and doc["parked_sessions"] >= 1
    assert doc["budget"]["pool_pages"] == doc["device_pool_pages"]
    planned = (doc["resident_sessions"], doc["parked_sessions"])
    argv = ["simulate", *SMALL, "--host-budget", "2MiB", "--budget", "2MiB", "--json", "--out", str(tmp_path)]
    assert main(argv) == 0
    sim = json.loads(capsys.readouterr().out)
    assert sim["mismatches"] == 0
    assert (sim["measured"]["resident_sessions"], sim["measured"]["parked_sessions"]) == planned
    assert main(["plan", *SMALL, "--host-budget", "2MiB", "--gpu", "H100"]) == 0
    assert "parked" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["plan", "--host-budget", "64GiB"], "--host-budget needs a device budget beside it"),
        (["plan", "--host-budget", "0", "--budget", "1GiB"], "--host-budget: must be a size > 0 bytes, got '0'"),
        (["plan", "--host-budget", "12XB", "--budget", "1GiB"], "--host-budget='12XB' is not a size"),
        (["plan", "--host-budget", "-5GiB", "--budget", "1GiB"], "must be a size > 0 bytes, got '-5GiB'"),
        (["plan", "--host-budget", "1GiB", "--branches", "2", "--budget", "1GiB"], "--branches and --host-budget"),
        (["plan", "--host-budget", "1GiB", "--budget", "1GiB", "--scene-cut-every", "3"], "--scene-cut-every 3"),
        (["simulate", "--host-budget", "1MiB"], "--host-budget needs --budget SIZE beside it"),
        (["simulate", "--budget", "1MiB"], "--budget applies to pagedqvg simulate only with --host-budget"),
    ],
)
def test_cli_bad_host_flags_exit_2_naming_them(capsys, argv, needle):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("pagedqvg: error: ") and needle in err, err
