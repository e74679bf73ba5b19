"""Sessions per device with a host tier: `plan --host-budget SIZE` (how many sessions stay open per device when idle
ones are parked in host memory, `SessionManager.swap_out` / `swap_in`).

A resident session reserves its planned peak on the device (`SessionManager` admits by planned peak: the pool
high-water of its caches in the planner's call pattern, `replay_layer(geom).pool_high_water(caches)`), so
`resident = pool pages // planned peak`, with `pool pages = (device budget - one transient view) // page_bytes`. A
parked session costs its swapped pages on the host: its caches' pages at a chunk boundary at steady state
(`caches * max(census.after)`: the window's pages, packed chunks packed), and reserves nothing on the device:
`parked = host pages // parked pages`, with `host pages = host budget // page_bytes`. Open sessions: resident +
parked. Serving a parked session swaps it in, which needs a resident slot: swap a resident one out first, which
needs room for one more on the host; with both tiers full, `resident + parked - 1` sessions rotate with every call
served.

`SessionManager` plans sessions without scene-cut pins (`SessionSpec` has none): a workload with
`scene_cut_every` is refused here (CacheConfigError). Tests compare these figures with a measured run
(pagedqvg/cli/fork_sim.py: real caches opened, swapped out until the host is full). O(replay of one layer).
"""

from __future__ import annotations

from pagedqvg.errors import CacheConfigError
from pagedqvg.planning.geometry import Geometry
from pagedqvg.planning.replay import replay_layer
from pagedqvg.validation import check_int

__all__ = ["host_report", "parked_session_pages", "resident_session_pages"]


def check_host(geom: Geometry, pool_pages: object, host_bytes: object) -> None:
    """CacheConfigError naming the bad value: pool pages an int >= 0, host bytes an int >= 1, no scene-cut pins,
    one session's geometry. O(1)."""
    wording = "{name} must be an int >= {minimum}, got {value!r}"
    check_int("device pool pages", pool_pages, minimum=0, error=CacheConfigError, message=wording,
              type_message=wording)  # fmt: skip
    wording = "{name} must be a size >= {minimum} bytes, got {value!r}"
    check_int("--host-budget", host_bytes, minimum=1, error=CacheConfigError, message=wording, type_message=wording)
    if geom.scene_cut_every:
        raise CacheConfigError(
            f"--host-budget with --scene-cut-every {geom.scene_cut_every}: SessionManager admits sessions by a plan "
            "without scene-cut pins (SessionSpec has none); drop --scene-cut-every (0)"
        )
    if geom.sessions != 1:
        raise CacheConfigError(
            f"--host-budget with --sessions {geom.sessions}: the host tier plans how many sessions fit; drop --sessions"
        )


def resident_session_pages(geom: Geometry) -> int:
    """Pages a resident session reserves: its planned peak (`SessionManager.planned_pages`). O(replay)."""
    return replay_layer(geom).pool_high_water(geom.caches)


def parked_session_pages(geom: Geometry) -> int:
    """Pages a parked session holds on the host: every cache's pages at a chunk boundary at steady state. O(replay)."""
    return geom.caches * max(replay_layer(geom).after)


def host_report(geom: Geometry, pool_pages: int, host_bytes: int) -> dict[str, object]:
    """JSON-ready: sessions per device resident (device pool of `pool_pages` pages) and parked (a host pool of
    `host_bytes` bytes), vs without a host tier. CacheConfigError for a bad value. O(replay of one layer)."""
    check_host(geom, pool_pages, host_bytes)
    census = replay_layer(geom)
    page = geom.page_bytes
    resident_pages = census.pool_high_water(geom.caches)
    parked_pages = geom.caches * max(census.after)
    host_pages = host_bytes // page
    resident = pool_pages // resident_pages
    parked = host_pages // parked_pages
    return {
        "page_bytes": page,
        "caches_per_session": geom.caches,
        "device_pool_pages": pool_pages,
        "device_pool_bytes": pool_pages * page,
        "host_budget_bytes": host_bytes,
        "host_pages": host_pages,
        "resident_session_pages": resident_pages,
        "resident_session_bytes": resident_pages * page,
        "parked_session_pages": parked_pages,
        "parked_session_bytes": parked_pages * page,
        "resident_sessions": resident,
        "parked_sessions": parked,
        "open_sessions": resident + parked,
        "rotating_sessions": max(resident, resident + parked - 1) if resident else 0,
        "without_host_tier": resident,
        "open_over_resident": round((resident + parked) / resident, 3) if resident else None,
    }


def format_host(doc: dict[str, object]) -> str:
    """The human lines of `host_report` (and of its measured twin, `cli/fork_sim.py`)."""
    from pagedqvg.allocator import format_bytes

    ratio = "no session fits the device" if doc["open_over_resident"] is None else f"{doc['open_over_resident']}x"
    lines = [
        f"host tier: device pool of {doc['device_pool_pages']:,} pages "
        f"({format_bytes(int(doc['device_pool_bytes']))}), host budget {format_bytes(int(doc['host_budget_bytes']))} "
        f"({doc['host_pages']:,} pages of {doc['page_bytes']:,} B)",
        f"  resident  {doc['resident_sessions']:,} session(s), each reserving its planned peak of "
        f"{doc['resident_session_pages']:,} pages ({format_bytes(int(doc['resident_session_bytes']))})",
        f"  parked    {doc['parked_sessions']:,} session(s), each holding its window's "
        f"{doc['parked_session_pages']:,} pages ({format_bytes(int(doc['parked_session_bytes']))}) on the host",
        f"  open      {doc['open_sessions']:,} session(s) per device vs {doc['without_host_tier']:,} without a host "
        f"tier ({ratio}); {doc['rotating_sessions']:,} rotate with every call served "
        "(a swap-in needs one free slot on either tier)",
    ]
    if "measured" in doc:
        m = doc["measured"]
        assert isinstance(m, dict)
        verdict = "yes" if doc["mismatches"] == 0 else f"NO ({doc['mismatch_text']})"
        lines.append(
            f"  measured (real caches, SessionManager.swap_out/swap_in): {m['resident_sessions']} resident, "
            f"{m['parked_sessions']} parked, {m['swap_out_pages']} pages per swap-out, {m['swap_in_pages']} per "
            f"swap-in; plan == measured: {verdict}"
        )
    return "\n".join(lines)
