"""The SGLang integration's structure: one integration object per process (no other module-level mutable state), one
table of hooked SGLang targets per version from which install() and the plugin both derive what they hook, the only
reads of SGLang private attributes in versions.py's adapters (each checked against SGLang's source when
PAGEDQVG_SGLANG_SRC is set), and the plugin's settings parsed once (sizes as the CLI reads them; quant knobs with
quantization off refused)."""

from __future__ import annotations

import ast
import os
import re
import types
from pathlib import Path

import pytest

from pagedqvg import IntegrationError, QuantConfig
from pagedqvg.integrations.sglang import integration as integ
from pagedqvg.integrations.sglang import plugin, versions
from pagedqvg.integrations.sglang.attention import attention_mode, set_attention_mode
from pagedqvg.integrations.sglang.plugin import PluginConfigError, settings_from_env
from pagedqvg.integrations.sglang.runtime import SGLangIntegration, integration
from pagedqvg.sizes import parse_size

PACKAGE = Path(integ.__file__).parent
SRC = os.environ.get("PAGEDQVG_SGLANG_SRC")
needs_src = pytest.mark.skipif(not SRC, reason="PAGEDQVG_SGLANG_SRC (SGLang source) unset")
TABLE = versions.targets_for(versions.CURRENT)


# ---------------------------------------------------------------- one object
def _module_state(path: Path) -> list[str]:
    """Module-level names of `path` bound to a mutable container or a lock / thread-local (constant tables in
    UPPER_CASE excepted), and every `global` statement."""
    found = []
    tree = ast.parse(path.read_text())
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else []
        targets = [node.target] if isinstance(node, ast.AnnAssign) else targets
        value = getattr(node, "value", None)
        for t in targets:
            name = t.id if isinstance(t, ast.Name) else ast.unparse(t)
            mutable = isinstance(value, (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp)) or (
                isinstance(value, ast.Call) and ast.unparse(value.func).split(".")[-1] in
                ("dict", "list", "set", "RLock", "Lock", "local", "SGLangIntegration", "defaultdict")
            )  # fmt: skip
            if mutable and not name.lstrip("_").isupper() and not name.startswith("__"):
                found.append(f"{path.name}:{name}")
            if mutable and name == "_INSTANCE":
                found.append(f"{path.name}:{name}")
    found += [f"{path.name}:global {', '.join(n.names)}" for n in ast.walk(tree) if isinstance(n, ast.Global)]
    return found


def test_the_only_module_level_state_is_the_one_integration_object():
    found = [x for p in sorted(PACKAGE.glob("*.py")) for x in _module_state(p)]
    assert found == ["runtime.py:_INSTANCE"]
    assert integration() is integration() and isinstance(integration(), SGLangIntegration)


def test_the_attention_mode_and_the_plugin_configuration_live_on_the_object():
    state = integration()
    try:
        set_attention_mode("pages")
        assert state.attention_mode == "pages" == attention_mode()
        integ.configure(budget_bytes=8 << 20, quant=QuantConfig(bits=2), quant_override=True)
        assert (state.budget_bytes, state.quant, state.quant_override) == (8 << 20, QuantConfig(bits=2), True)
    finally:
        state.reset()
    assert (state.attention_mode, state.budget_bytes, state.quant, state.quant_override) == ("view", None, None, False)


def test_no_module_is_over_600_lines():
    lines = {p.name: len(p.read_text().splitlines()) for p in PACKAGE.glob("*.py")}
    assert max(lines.values()) <= 600, lines


# ---------------------------------------------------------------- one table per version
def test_each_target_is_listed_once_and_both_entry_points_derive_from_the_table():
    paths = [t.path for t in TABLE]
    assert len(paths) == len(set(paths))
    by_kind = {k: [t.path for t in TABLE if t.kind == k] for k in {t.kind for t in TABLE}}
    assert (*by_kind["allocate"], *by_kind["allocate_lingbot"]) == plugin.HOOK_TARGETS
    assert tuple(by_kind["forward"]) == plugin.FORWARD_TARGETS and len(by_kind["forward"]) == 3
    assert [
        *by_kind["dispose"], *by_kind["attention"], *by_kind["worker"]
    ] == [plugin.DISPOSE_TARGET, plugin.ATTENTION_TARGET, plugin.WORKER_TARGET]
    assert set(integ.HOOKS) == {"allocate", "allocate_lingbot", "forward", "dispose"}  # what install() wraps
    assert tuple(by_kind["binding"]) == integ.BINDING_MODULES
    assert all(t.why for t in TABLE)


def test_another_sglang_version_is_refused_with_the_versions():
    with pytest.raises(IntegrationError, match=r"SGLang 0\.5\.24 found; pagedqvg hooks SGLang 0\.5\.23 .*PAGEDQVG=off"):
        versions.targets_for("0.5.24")


# ---------------------------------------------------------------- the adapters of SGLang private attributes
def test_no_sglang_private_attribute_outside_the_adapters():
    reads = {}
    for p in sorted(PACKAGE.glob("*.py")):
        for m in re.finditer(r'getattr\([^,]+, "(_[a-z][a-z_]*)"', p.read_text()):
            reads.setdefault(m.group(1), set()).add(p.name)
    assert reads == {"_patched": {"versions.py"}, "_states": {"versions.py"}, "_kv_quant_args": {"versions.py"}}
    assert not re.search(r"HookRegistry\._", (PACKAGE / "plugin.py").read_text())


def test_the_adapters_check_the_shape_they_assume():
    registry = type("HookRegistry", (), {"_patched": {"a.b"}})
    assert versions.patched_targets(registry) == {"a.b"}
    for changed in ({"a.b": 1}, ["a.b"], None):
        registry._patched = changed
        with pytest.raises(IntegrationError, match=r"HookRegistry\._patched is .*cannot tell whether its hooks"):
            versions.patched_targets(registry)
    assert versions.realtime_states(None) == {}
    assert versions.realtime_states(types.SimpleNamespace(_states={"s": 1})) == {"s": 1}
    with pytest.raises(IntegrationError, match=r"_states is NoneType, not the dict of realtime states"):
        versions.realtime_states(types.SimpleNamespace())
    args = types.SimpleNamespace(enabled=True)
    assert versions.stage_quant_args(types.SimpleNamespace(_kv_quant_args=args)) is args
    assert versions.stage_quant_args(types.SimpleNamespace()) is None
    with pytest.raises(IntegrationError, match=r"_kv_quant_args is str without `enabled`"):
        versions.stage_quant_args(types.SimpleNamespace(_kv_quant_args="int2"))


def _sglang_source(*parts: str) -> str:
    path = Path(SRC, "sglang", "multimodal_gen", "runtime", *parts)
    return "\n".join(p.read_text() for p in ([path] if path.is_file() else sorted(path.rglob("*.py"))))


@needs_src
def test_the_adapters_hold_for_sglang_source():
    plugins = _sglang_source("platforms", "plugins.py")
    registry = plugins[plugins.index("class HookRegistry") :]
    assert re.search(r"_patched\s*(:[^=\n]*)?=\s*set\(", registry), "HookRegistry._patched is no longer a set"
    realtime = _sglang_source("realtime")
    assert re.search(r"self\._states\s*(:[^=\n]*)?=\s*\{\}|self\._states\s*(:[^=\n]*)?=\s*dict\(", realtime)
    lingbot = _sglang_source("pipelines_core", "stages", "model_specific_stages", "lingbot_world")
    assert re.search(r"self\._kv_quant_args\s*(:[^=\n]*)?=", lingbot), "LingBot-World's stage lost _kv_quant_args"


# ---------------------------------------------------------------- settings parsed once
@pytest.mark.parametrize("raw", ["2M", "1.5GB", "24GiB", "512 MiB", "1048576", "0.5G"])
def test_sizes_are_read_as_the_cli_reads_them(raw):
    s = settings_from_env({"PAGEDQVG_BUDGET": raw})
    assert s.active and s.budget_bytes == parse_size(raw)
    assert settings_from_env({"PAGEDQVG_BUDGET": "2M"}).budget_bytes == 2 << 20


@pytest.mark.parametrize("raw", ["512KiB", "0", "-5GiB"])
def test_a_size_below_one_page_names_the_variable_the_value_and_the_minimum(raw):
    with pytest.raises(PluginConfigError, match=rf"PAGEDQVG_BUDGET='{raw}' is -?\d+ bytes, below one page .*1MiB"):
        settings_from_env({"PAGEDQVG_BUDGET": raw})


@pytest.mark.parametrize(
    "knob",
    [
        ("PAGEDQVG_KV_CACHE_QUANT_KEEP_RECENT", "2"),
        ("PAGEDQVG_KV_CACHE_QUANT_SINK", "int4"),
        ("PAGEDQVG_KV_CACHE_QUANT_RECENT", "fp8"),
        ("PAGEDQVG_KV_CACHE_QUANT_CENTROIDS", "16"),
    ],
)
def test_a_quant_knob_with_quantization_off_is_refused(knob, monkeypatch):
    env = {"PAGEDQVG_BUDGET": "1GiB", "PAGEDQVG_KV_CACHE_QUANT": "off", knob[0]: knob[1]}
    wording = rf"{knob[0]}='{knob[1]}' set with PAGEDQVG_KV_CACHE_QUANT='off' .*valid: PAGEDQVG_KV_CACHE_QUANT=int4"
    with pytest.raises(PluginConfigError, match=wording):
        settings_from_env(env)
    for key in [k for k in os.environ if k.startswith("PAGEDQVG")]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(SystemExit, match=wording):  # SGLang's load_plugins swallows Exception, not SystemExit
        plugin.register()


def test_quantization_off_alone_overrides_every_stage_as_a_parsed_config():
    s = settings_from_env({"PAGEDQVG_BUDGET": "1GiB", "PAGEDQVG_KV_CACHE_QUANT": "off"})
    assert isinstance(s.quant, QuantConfig) and not s.quant.enabled and "quantization: off" in s.describe()
    assert settings_from_env({"PAGEDQVG_BUDGET": "1GiB"}).quant is None  # unset: each stage's own


@needs_src
def test_every_target_of_the_table_exists_in_sglang_source():
    """Each module of the table is a file (or package) of SGLang's source, and each class / method / function it
    names is defined there (parsed, not imported)."""
    for t in TABLE:
        rel = Path(SRC, *t.module.split("."))
        path = rel.with_suffix(".py") if rel.with_suffix(".py").is_file() else rel / "__init__.py"
        assert path.is_file(), t.path
        if not t.qualname:
            continue
        tree = ast.parse(path.read_text())
        scope = tree.body
        for part in t.qualname.split("."):
            node = next((n for n in scope if getattr(n, "name", None) == part), None)
            assert node is not None, f"{t.path}: {part} not defined in {path}"
            scope = getattr(node, "body", [])
