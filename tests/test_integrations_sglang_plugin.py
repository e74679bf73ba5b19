"""pagedqvg.integrations.sglang.plugin without SGLang: every environment value (good and bad), the SystemExit that
stops a process on a bad one (SGLang swallows a plugin's Exception), the version and signature checks, the entry
point declared in pyproject.toml, and the AROUND hooks against stand-in stages. SGLang's real load_plugins(),
HookRegistry and DiffGenerator run in .ci/sglang_runtime.sh."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import sequencer_spec

from pagedqvg import BlockPool, IntegrationError, QuantConfig
from pagedqvg.integrations.sglang import integration as integ
from pagedqvg.integrations.sglang import plugin
from pagedqvg.integrations.sglang.plugin import PluginConfigError, settings_from_env
from pagedqvg.integrations.sglang.runtime import integration
from pagedqvg.integrations.sglang.versions import CURRENT, targets_for

GiB, MiB = 1 << 30, 1 << 20
SINK, RECENT = "PAGEDQVG_KV_CACHE_QUANT_SINK", "PAGEDQVG_KV_CACHE_QUANT_RECENT"
#: Bad tier variables: (history format, tier variables, the variable the message names, a fragment of its reason).
TIER_BAD = [
    ("int2", {RECENT: "int3"}, RECENT, "not a tier format"),
    ("int2", {RECENT: ""}, RECENT, "not a tier format"),
    ("int2", {SINK: "int3"}, SINK, "fp8, int4, int2, compact"),
    ("int4", {RECENT: "int2"}, RECENT, "coarser than the history's 'int4'"),
    ("compact", {RECENT: "compact", SINK: "fp9"}, SINK, f"{RECENT}='compact'"),
    ("int2", {RECENT: "fp8", "PAGEDQVG_KV_CACHE_QUANT_KEEP_RECENT": "0"}, RECENT, "KEEP_RECENT='0'"),
    ("int2", {"PAGEDQVG_KV_CACHE_QUANT_RECENT_FORMAT": "int4"}, "PAGEDQVG_KV_CACHE_QUANT_RECENT_FORMAT", "unknown"),
]
BAD = [
    ({"PAGEDQVG_BUDGET": "-5GiB"}, "PAGEDQVG_BUDGET", "'-5GiB'"),
    ({"PAGEDQVG_BUDGET": "lots"}, "PAGEDQVG_BUDGET", "'lots'"),
    ({"PAGEDQVG_BUDGET": "24GB/s"}, "PAGEDQVG_BUDGET", "'24GB/s'"),
    ({"PAGEDQVG_BUDGET": "24XiB"}, "PAGEDQVG_BUDGET", "'24XiB'"),
    ({"PAGEDQVG_BUDGET": "1.5"}, "PAGEDQVG_BUDGET", "whole number of bytes"),
    ({"PAGEDQVG_BUDGET": "512KiB"}, "PAGEDQVG_BUDGET", "below one page"),
    ({"PAGEDQVG_BUDGET": "0"}, "PAGEDQVG_BUDGET", "below one page"),
    ({"PAGEDQVG_MEMORY_FRACTION": "0"}, "PAGEDQVG_MEMORY_FRACTION", "(0, 1]"),
    ({"PAGEDQVG_MEMORY_FRACTION": "1.5"}, "PAGEDQVG_MEMORY_FRACTION", "(0, 1]"),
    ({"PAGEDQVG_MEMORY_FRACTION": "-0.5"}, "PAGEDQVG_MEMORY_FRACTION", "(0, 1]"),
    ({"PAGEDQVG_MEMORY_FRACTION": "half"}, "PAGEDQVG_MEMORY_FRACTION", "(0, 1]"),
    ({"PAGEDQVG_MEMORY_FRACTION": "nan"}, "PAGEDQVG_MEMORY_FRACTION", "(0, 1]"),
    ({"PAGEDQVG_BUDGET": "1GiB", "PAGEDQVG_MEMORY_FRACTION": "0.5"}, "PAGEDQVG_MEMORY_FRACTION", "valid: one"),
    ({"PAGEDQVG_BUDGET": "1GiB", "PAGEDQVG_KV_CACHE_QUANT": "int3"}, "PAGEDQVG_KV_CACHE_QUANT", "compact"),
    (
        {"PAGEDQVG_BUDGET": "1GiB", "PAGEDQVG_KV_CACHE_QUANT": "int2", "PAGEDQVG_KV_CACHE_QUANT_CENTROIDS": "many"},
        "PAGEDQVG_KV_CACHE_QUANT_CENTROIDS",
        "'many'",
    ),
    (
        {"PAGEDQVG_BUDGET": "1GiB", "PAGEDQVG_KV_CACHE_QUANT": "int2", "PAGEDQVG_KV_CACHE_QUANT_CENTROID": "8"},
        "PAGEDQVG_KV_CACHE_QUANT_CENTROID",
        "unknown",
    ),
    ({"PAGEDQVG_BUDGET": "1GiB", "PAGEDQVG_KV_CACHE_QUANT_STAGES": "2"}, "PAGEDQVG_KV_CACHE_QUANT_STAGES", "without"),
    ({"PAGEDQVG_BUDGET": "1GiB", RECENT: "int4"}, RECENT, "without"),
    *[
        ({"PAGEDQVG_BUDGET": "1GiB", "PAGEDQVG_KV_CACHE_QUANT": base, **tiers}, variable, fragment)
        for base, tiers, variable, fragment in TIER_BAD
    ],
    ({"PAGEDQVG_KV_CACHE_QUANT": "int2"}, "PAGEDQVG_KV_CACHE_QUANT", "PAGEDQVG_BUDGET"),
    ({"PAGEDQVG": "on"}, "PAGEDQVG", "PAGEDQVG_BUDGET"),
    ({"PAGEDQVG": "maybe"}, "PAGEDQVG", "valid: off"),
]


@pytest.mark.parametrize(("env", "variable", "fragment"), BAD, ids=[str(e) for e, _, _ in BAD])
def test_each_bad_value_names_variable_value_and_valid_forms(env, variable, fragment):
    with pytest.raises(PluginConfigError) as info:
        settings_from_env(env)
    message = str(info.value)
    assert f"{variable}=" in message and fragment in message and "valid" in message


@pytest.mark.parametrize(("env", "variable", "fragment"), BAD[:3] + BAD[-6:], ids=str)
def test_register_stops_the_process_on_a_bad_value(monkeypatch, env, variable, fragment):
    """SystemExit, not an Exception: SGLang's load_plugins() catches Exception and goes on with its own caches."""
    for key in [k for k in __import__("os").environ if k.startswith("PAGEDQVG")]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(SystemExit) as info:
        plugin.register()
    assert not isinstance(info.value, Exception)
    assert str(info.value).startswith("pagedqvg: ") and f"{variable}=" in str(info.value)


@pytest.mark.parametrize(
    ("raw", "size"),
    [("24GiB", 24 * GiB), ("24 GiB", 24 * GiB), ("1.5GB", 1_500_000_000), ("1048576", MiB), ("64mib", 64 * MiB)],
)
def test_sizes(raw, size):
    settings = settings_from_env({"PAGEDQVG_BUDGET": raw})
    assert settings.active and settings.budget_bytes == size and settings.memory_fraction is None


def test_inactive_without_a_budget_or_when_switched_off():
    unset = settings_from_env({})
    assert not unset.active and "PAGEDQVG_BUDGET=24GiB" in unset.reason and "PAGEDQVG_MEMORY_FRACTION" in unset.reason
    off = settings_from_env({"PAGEDQVG": "off", "PAGEDQVG_BUDGET": "garbage"})  # off: nothing else is read
    assert not off.active and "PAGEDQVG=off" in off.reason


def test_quant_variables_are_parsed_once_into_a_quant_config():
    env = {
        "PAGEDQVG_MEMORY_FRACTION": "0.5",
        "PAGEDQVG_KV_CACHE_QUANT": "int2",
        "PAGEDQVG_KV_CACHE_QUANT_CENTROIDS": "16",
        "PAGEDQVG_KV_CACHE_QUANT_KEEP_RECENT": "0",
    }
    s = settings_from_env(env)
    assert s.active and s.memory_fraction == 0.5
    assert s.quant == QuantConfig(bits=2, centroids=16, keep_recent_chunks=0)  # typed, parsed at registration
    assert "quantization: int2 (bits 2, 16 centroids, block 64, keep_recent 0)" in s.describe()


@pytest.mark.parametrize(
    ("base", "tiers", "expected"),
    [
        ("compact", {SINK: "int4", RECENT: "int4"}, QuantConfig.compact(sink_format="int4", recent_format="int4")),
        ("int2", {SINK: "bf16", RECENT: "fp8"}, QuantConfig(bits=2, sink=False, recent_format="fp8")),
        ("int2", {SINK: "FP8", RECENT: " int2 "}, QuantConfig(bits=2, sink_format="fp8", recent_format="int2")),
        ("int4", {SINK: "true", RECENT: "bf16"}, QuantConfig(bits=4)),
        ("int4", {SINK: "off"}, QuantConfig(bits=4, sink=False)),
    ],
)
def test_tier_variables_reach_the_sglang_mapping(base, tiers, expected):
    """PAGEDQVG_KV_CACHE_QUANT_SINK / _RECENT become the tier formats of the settings' `QuantConfig` (sink_format /
    recent_format), unchanged by the integration's mapping; describe() names the tiers of a tiered setting."""
    s = settings_from_env({"PAGEDQVG_BUDGET": "1GiB", "PAGEDQVG_KV_CACHE_QUANT": base, **tiers})
    assert s.quant == expected
    assert integ.quant_config_from_sglang(s.quant, 128) == expected
    tiers_line = ", ".join(f"{t} {expected.tier_format(t)}" for t in ("sink", "recent", "history"))
    assert (f"(tiers: {tiers_line})" in s.describe()) == expected.tiered


def test_another_sglang_version_stops_with_the_version(monkeypatch):
    import importlib.metadata as md

    monkeypatch.setattr(md, "version", lambda name: "0.5.24" if name == "sglang" else "0")
    for key in [k for k in __import__("os").environ if k.startswith("PAGEDQVG")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("PAGEDQVG_BUDGET", "64MiB")
    with pytest.raises(SystemExit, match=r"SGLang 0\.5\.24 found; .*0\.5\.23"):
        plugin.register()


def test_entry_point_is_declared():
    """The table SGLang's load_plugins() reads (its discovery from the installed metadata runs in CI)."""
    text = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    table = text.split('[project.entry-points."sglang.multimodal_gen.plugins"]\n', 1)[1].split("\n[", 1)[0]
    assert [line for line in table.splitlines() if line.strip()] == [
        'pagedqvg = "pagedqvg.integrations.sglang.plugin:register"'
    ]


# ------------------------------------------------------------------------------------------ hooks on stand-in stages
class _Stage:
    num_transformer_blocks = 2
    _kv_quant_args = None

    def _allocate_causal_kv_cache(
        self,
        *,
        batch_size,
        kv_cache_size,
        num_attention_heads,
        attention_head_dim,
        dtype,
        device,
        use_int_indices=False,
        sink_tokens=0,
        global_sink_tokens=0,
        attention_window_size=None,
        allow_growth=False,
    ):
        return ["sglang's own"]


ARGS = dict(batch_size=1, kv_cache_size=16, num_attention_heads=2, attention_head_dim=8, dtype=torch.float32,
            device="cpu", sink_tokens=4, global_sink_tokens=2)


@pytest.fixture
def configured():
    pool = BlockPool(capacity_bytes=4 * MiB, page_bytes=4096)
    integration().configure(pool=pool)
    yield integ
    integration().reset()


def _override(quant: QuantConfig | None) -> None:
    """The plugin's PAGEDQVG_KV_CACHE_QUANT* override (parsed) for every stage, the pool kept."""
    state = integration()
    state.configure(pool=state.pool_given, quant=quant, quant_override=True)


def test_base_hook_builds_paged_caches_and_quant_override(configured):
    original = _Stage._allocate_causal_kv_cache
    caches = integ.allocate_around(original, _Stage(), **ARGS)
    assert [type(c) for c in caches] == [integ.PagedCausalSelfAttentionKVCache] * 2
    _override(QuantConfig.from_dict({"kv_cache_quant": "int2", "kv_cache_quant_centroids": "4"}))
    packed = integ.allocate_around(original, _Stage(), **ARGS)
    assert [type(c) for c in packed] == [integ.PagedQVGPackedCausalKVCache] * 2
    assert sequencer_spec(packed[0]).global_sink_tokens == 2  # SGLang's QVG path refuses a global sink


def test_tier_variables_reach_the_packed_caches(configured):
    """PAGEDQVG_KV_CACHE_QUANT_SINK / _RECENT through the hook: every packed cache ages by them (sink and recent int4,
    history int2 here; formats per retained token from `memory_breakdown` after three chunks and a fourth written)."""
    env = {"PAGEDQVG_BUDGET": "1GiB", "PAGEDQVG_KV_CACHE_QUANT": "int2", "PAGEDQVG_KV_CACHE_QUANT_CENTROIDS": "4",
           SINK: "int4", RECENT: "int4"}  # fmt: skip
    _override(settings_from_env(env).quant)
    args = {**ARGS, "kv_cache_size": 24, "global_sink_tokens": 4}
    caches = integ.allocate_around(_Stage._allocate_causal_kv_cache, _Stage(), **args)
    assert [type(c) for c in caches] == [integ.PagedQVGPackedCausalKVCache] * 2
    q = caches[0].quant
    assert [q.tier_format(t) for t in ("sink", "recent", "history")] == ["int4", "int4", "int2"]
    gen = torch.Generator().manual_seed(0)
    for chunk in range(4):  # 4-token chunks: the sink, a history chunk, the recent chunk, the current chunk
        kv = [torch.randn(1, 4, 2, 8, generator=gen) for _ in range(2)]
        caches[0].update_and_get_attention_kv(key=kv[0], value=kv[1], current_chunk_start=4 * chunk)
    formats = {k: v for k, v in caches[0].memory_breakdown().items() if k.endswith("_tokens")}
    assert formats == {"dense_tokens": 4, "packed_tokens": 12, "int4_tokens": 8, "int2_tokens": 4}


def test_lingbot_hook_delegates_to_sglang_when_quantization_is_off(configured):
    original = _Stage._allocate_causal_kv_cache
    assert integ.lingbot_allocate_around(original, _Stage(), **ARGS) == ["sglang's own"]

    class FlagsOn(_Stage):
        _kv_quant_args = type("Q", (), {"enabled": True, "bits": 2, "centroids": 4, "block_size": 8, "stages": 1,
                                        "kmeans_iters": 2, "asymmetric": False, "keep_recent_chunks": 1,
                                        "sink": True, "sink_keep_chunks": 0})()

    assert type(integ.lingbot_allocate_around(original, FlagsOn(), **ARGS)[0]) is integ.PagedQVGPackedCausalKVCache
    _override(settings_from_env({"PAGEDQVG_BUDGET": "1GiB", "PAGEDQVG_KV_CACHE_QUANT": "off"}).quant)  # wins
    assert type(integ.lingbot_allocate_around(original, FlagsOn(), **ARGS)[0]) is integ.PagedCausalSelfAttentionKVCache


def test_a_changed_signature_is_refused(configured):
    def changed(self, *, batch_size, kv_cache_size, num_heads, head_dim, dtype, device):
        return []

    with pytest.raises(IntegrationError, match=r"num_heads.*sglang==0\.5\.23"):
        integ.allocate_around(changed, _Stage(), **ARGS)


def test_a_worker_whose_hooks_sglang_did_not_apply_stops(monkeypatch):
    """SGLang logs and skips a hook it cannot apply; the BEFORE hook on the worker's run_scheduler_process stops the
    worker then instead of letting it run on SGLang's dense caches."""
    import sys
    import types

    name = "sglang.multimodal_gen.runtime.platforms.plugins"
    parts = name.split(".")
    for i in range(1, len(parts) + 1):
        monkeypatch.setitem(sys.modules, ".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
    registry = type("HookRegistry", (), {"_patched": {plugin.HOOK_TARGETS[0], *plugin.FORWARD_TARGETS}})
    sys.modules[name].HookRegistry = registry
    with pytest.raises(SystemExit, match=r"could not apply the hooks on .*LingBotWorld.*PAGEDQVG=off"):
        plugin._require_hooks_applied("spec")
    registry._patched = set(plugin._hook_targets())
    assert plugin._require_hooks_applied("spec") is None


def test_attention_variable():
    """PAGEDQVG_ATTENTION: auto (unset, empty), view or pages, case-insensitive; a bad value names the variable and the
    valid forms; asking for pages without a budget is refused like the quantization variable."""
    base = {"PAGEDQVG_BUDGET": "1GiB"}
    assert settings_from_env(base).attention == "auto"  # the default: view, or heads where allowlisted
    assert settings_from_env({**base, "PAGEDQVG_ATTENTION": ""}).attention == "auto"
    assert settings_from_env({**base, "PAGEDQVG_ATTENTION": " Pages "}).attention == "pages"
    assert "from pages" in settings_from_env({**base, "PAGEDQVG_ATTENTION": "pages"}).describe()
    with pytest.raises(PluginConfigError, match=r"PAGEDQVG_ATTENTION='paged'.*valid: view or pages"):
        settings_from_env({**base, "PAGEDQVG_ATTENTION": "paged"})
    with pytest.raises(PluginConfigError, match=r"PAGEDQVG_ATTENTION='pages' asks for pagedqvg.*PAGEDQVG_BUDGET"):
        settings_from_env({"PAGEDQVG_ATTENTION": "pages"})


def test_pages_mode_requires_its_attention_hook(monkeypatch):
    """In pages mode the worker also stops when SGLang did not apply the LocalAttention.forward hook."""
    import sys
    import types

    from pagedqvg.integrations.sglang import attention as sglang_attention

    name = "sglang.multimodal_gen.runtime.platforms.plugins"
    parts = name.split(".")
    for i in range(1, len(parts) + 1):
        monkeypatch.setitem(sys.modules, ".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
    registry = type("HookRegistry", (), {"_patched": set(plugin._hook_targets())})
    sys.modules[name].HookRegistry = registry
    before = sglang_attention.set_attention_mode("pages")
    try:
        with pytest.raises(SystemExit, match=r"LocalAttention\.forward"):
            plugin._require_hooks_applied("spec")
        registry._patched = set(plugin._hook_targets()) | {plugin.ATTENTION_TARGET}
        assert plugin._require_hooks_applied("spec") is None
    finally:
        sglang_attention.set_attention_mode(before)


def test_pages_attention_around_falls_back_to_sglang_for_other_calls():
    """The AROUND hook hands every call that is not a pages-mode view's K/V pair to SGLang's own forward."""
    from pagedqvg.integrations.sglang.attention import pages_attention_around

    calls = []

    def original(layer, q, k, v, attn_mask):
        calls.append((q, k, v, attn_mask))
        return "sglang"

    q = k = v = torch.zeros(1, 2, 1, 4)
    assert pages_attention_around(original, object(), q, k, v) == "sglang"
    assert pages_attention_around(original, object(), q, k, v, attn_mask=torch.ones(1)) == "sglang"
    assert len(calls) == 2


def test_register_hooks_request_end_and_realtime_release(monkeypatch, caplog):
    """Active, register() adds to the allocation hooks the AROUND hooks on the causal stages' forward (request end:
    the allocations' sessions close) and the BEFORE hook on the realtime state's dispose; after a request one log
    line gives the pool's pages in use and the open sessions."""
    import logging
    import sys
    import types

    from pagedqvg.integrations.sglang import sessions as sglang_sessions

    for key in [k for k in __import__("os").environ if k.startswith("PAGEDQVG")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("PAGEDQVG_BUDGET", "64MiB")
    monkeypatch.setattr(plugin, "_check_sglang_version", lambda: targets_for(CURRENT))
    name = "sglang.multimodal_gen.runtime.platforms.plugins"
    parts = name.split(".")
    for i in range(1, len(parts) + 1):
        monkeypatch.setitem(sys.modules, ".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
    hooks = {}
    hook_type = types.SimpleNamespace(AROUND="around", BEFORE="before")
    sys.modules[name].HookType = hook_type
    sys.modules[name].plugin_hook = lambda target, kind: lambda fn: hooks.setdefault(target, (kind, fn))
    monkeypatch.setattr(integration(), "request_listeners", [])
    monkeypatch.setattr(integration(), "cache_listeners", [])
    try:
        plugin.register()
        for target in plugin.FORWARD_TARGETS:
            assert hooks[target] == ("around", sglang_sessions.forward_around)
        assert hooks[plugin.DISPOSE_TARGET] == ("before", sglang_sessions.dispose_before)
        assert set(plugin._hook_targets()) <= set(hooks)
        pool = BlockPool(capacity_bytes=4 * MiB, page_bytes=4096)
        with caplog.at_level(logging.INFO, logger="pagedqvg.sglang"):
            plugin._log_request_end(_Stage(), [pool])
        assert f"_Stage request done; pool cpu: 0 of {pool.num_pages} pages in use; 0 open sessions" in caplog.text
    finally:
        integration().reset()
