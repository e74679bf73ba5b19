"""The package root (pagedqvg/__init__.py): its public names, and what importing it loads.

`import pagedqvg` must not import triton (installs without Triton use the torch path) nor the cache and kernels:
`PagedCausalKVCache` / `make_layer_caches` load on first use, so the planner and the CLI's plan commands stay free
of the kernels. Checked in fresh interpreters (this process has imported everything already)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import pagedqvg
from pagedqvg import debug, errors, quant, view
from pagedqvg.allocator import pool, range_index
from pagedqvg.cache import paged_cache as cache


def test_every_public_name_is_the_defining_module_object():
    homes = {
        "BlockPool": pool, "PoolStats": pool, "RangeIndex": range_index, "QuantConfig": quant,
        "CausalAttentionKVView": view, "PagedCausalKVCache": cache, "make_layer_caches": cache,
        "debug_checks": debug, "set_debug_checks": debug,
    }  # fmt: skip
    for name in pagedqvg.__all__:
        home = homes.get(name, errors)
        assert getattr(pagedqvg, name) is getattr(home, name), name
    assert set(pagedqvg.__all__) == set(homes) | {n for n in vars(errors) if n[0].isupper() and n.endswith(
        ("Error", "Warning"))}  # fmt: skip
    assert isinstance(pagedqvg.__version__, str) and pagedqvg.__version__.count(".") == 2


def test_unknown_attribute_is_an_attribute_error_naming_it():
    with pytest.raises(AttributeError, match="module 'pagedqvg' has no attribute 'PagedCache'"):
        pagedqvg.PagedCache  # noqa: B018


def loaded_after(code: str) -> set[str]:
    """The pagedqvg / triton modules loaded in a fresh interpreter after running `code`."""
    script = code + (
        "\nimport json, sys\n"
        "print('JSON' + json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('pagedqvg', 'triton'))))"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    return set(json.loads(out.stdout.split("JSON", 1)[1]))


def test_import_loads_neither_triton_nor_the_cache_nor_the_kernels():
    mods = loaded_after("import pagedqvg")
    assert "pagedqvg.quant" in mods and "pagedqvg.allocator" in mods  # the check sees what was loaded
    assert not {m for m in mods if m == "triton" or m.startswith(("triton.", "pagedqvg.kernels"))}, mods
    assert "pagedqvg.cache.paged_cache" not in mods
    mods = loaded_after("import pagedqvg.planning.planner")
    assert not {m for m in mods if m.startswith(("triton", "pagedqvg.kernels"))}, mods
    mods = loaded_after("import pagedqvg\npagedqvg.PagedCausalKVCache")
    assert "pagedqvg.cache.paged_cache" in mods and "triton" not in mods  # the cache loads on first use, not triton
