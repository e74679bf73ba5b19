"""SGLang attention mode `heads` (pagedqvg.integrations.sglang.head_groups) with SGLang stand-ins (no SGLang
install): `LocalAttention.forward` called per head group gives mode `view`'s output bit for bit (SDPA backend; quant
off and int2; whole calls and Ulysses head slices; fixed and cost-model group sizes); calls that must run whole
(a backend not known per-head, GQA, SGLang's autotune pending on a call it would time) do, with one log line; the
variables' parsing; the default allowlist as data; the default (`PAGEDQVG_ATTENTION` unset, mode `auto`): heads only
for allowlisted (backend, device type, torch version), view otherwise, an explicit `view` always view, the output
mode view's bit for bit either way (fp32 and bf16, quant off and int2), one log line per decision.
"""

from __future__ import annotations

import logging
import sys
import types

import pytest
import torch

from pagedqvg import BlockPool, CacheConfigError
from pagedqvg.integrations.sglang import attention as attn
from pagedqvg.integrations.sglang import head_groups as hg
from pagedqvg.integrations.sglang.integration import PagedCausalSelfAttentionKVCache, PagedQVGPackedCausalKVCache
from pagedqvg.integrations.sglang.plugin import PluginConfigError, settings_from_env
from pagedqvg.integrations.sglang.runtime import integration

B, H, D, C, CHUNK = 1, 6, 64, 24, 4
SDPA = torch.nn.functional.scaled_dot_product_attention


class LocalAttention:
    """SGLang's `LocalAttention` as far as mode `heads` sees it: `backend`, `softmax_scale`, `attn_impl`, and a
    forward that (like SGLang's SDPA backend) transposes to `[B, h, T, D]` and calls SDPA; `calls` records the
    heads of each call."""

    softmax_scale = D**-0.5

    def __init__(self, backend: str = "TORCH_SDPA") -> None:
        self.backend = types.SimpleNamespace(name=backend)
        self.attn_impl = types.SimpleNamespace(forward=lambda *a, **kw: None)
        self.calls: list[int] = []

    def forward(self, q, k, v, attn_mask=None):
        assert not isinstance(k, attn.PagesKV) or attn_mask is not None  # a pages pair never reaches the original
        self.calls.append(q.shape[2])
        out = SDPA(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=self.softmax_scale)
        return out.transpose(1, 2)


@pytest.fixture
def patched():
    """LocalAttention.forward wrapped as `install(attention="heads")` wraps it; modes reset afterwards."""
    module = types.ModuleType(attn.ATTENTION_LAYER_MODULE)
    original = LocalAttention.forward
    module.LocalAttention = LocalAttention
    sys.modules[attn.ATTENTION_LAYER_MODULE] = module
    attn.patch_attention(lambda owner, a, new, label, done: setattr(owner, a, new), [])
    integration().heads_said.clear()
    yield
    LocalAttention.forward = original
    del sys.modules[attn.ATTENTION_LAYER_MODULE]
    attn.set_attention_mode("view")
    state = integration()
    state.head_group, state.head_group_read_env, state.head_group_choices = None, False, {}


def dense_cache(dtype=torch.float32):
    buf = torch.zeros(B, C, H, D, dtype=dtype)
    pool = BlockPool(capacity_bytes=1 << 21, page_bytes=4096)
    return PagedCausalSelfAttentionKVCache(buf, buf, torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long),
                                           0, 0, sink_tokens=CHUNK, pool=pool)  # fmt: skip


def packed_cache():
    q = dict(enabled=True, bits=2, centroids=16, block_size=64, stages=1, kmeans_iters=2, asymmetric=False,
             keep_recent_chunks=1, sink=True, sink_keep_chunks=0)  # fmt: skip
    return PagedQVGPackedCausalKVCache(
        batch_size=B, cache_size=C, num_heads=H, head_dim=D, dtype=torch.float32, device="cpu",
        global_end_index=torch.zeros(1, dtype=torch.long), local_end_index=torch.zeros(1, dtype=torch.long),
        use_int_indices=True, sink_tokens=CHUNK, quant_args=types.SimpleNamespace(**q),
        pool=BlockPool(capacity_bytes=1 << 21, page_bytes=4096),
    )  # fmt: skip


def calls(seed=0, heads_of_query=None):
    """Per chunk: a rewrite of every head, one of heads [2, 5) (a Ulysses rank's slice), an advance; 8 chunks."""
    gen = torch.Generator().manual_seed(seed)
    for chunk in range(8):
        for h0, heads in ((None, H), (2, 3), (None, H)):
            k, v = (torch.randn(B, CHUNK, heads, D, generator=gen) * 3 for _ in range(2))
            q = torch.randn(B, CHUNK, heads_of_query or heads, D, generator=gen) * 3
            yield q, dict(key=k, value=v, current_chunk_start=chunk * CHUNK, cache_head_start=h0)


def run(mode, make, layer, group=None, dtype=None, **kw):
    """Outputs of `layer.forward(q, view.k, view.v)` over `calls()` in `mode` (queries cast to `dtype` if given)."""
    attn.set_attention_mode(mode)
    hg.set_head_group_size(group)
    cache = make()
    out = []
    for q, c in calls(**kw):
        view = cache.update_and_get_attention_kv(**c)
        out.append(layer.forward(q if dtype is None else q.to(dtype), view.k, view.v))
    return out


@pytest.mark.parametrize("make", [dense_cache, packed_cache], ids=["quant-off", "int2"])
@pytest.mark.parametrize("group", [1, 2, 4, None])
def test_heads_mode_equals_view_mode_bit_for_bit(patched, make, group):
    layer = LocalAttention()
    want = run("view", make, layer)
    assert layer.calls == [H, 3, H] * 8  # mode view: the original once per call, every head of the view
    layer.calls.clear()
    got = run("heads", make, layer, group)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), i
    g = group or H  # the cost model at 4 queries: no size reaches 90% of 132 SMs; the most efficient is all heads
    per_call = [[min(g, n - a) for a in range(0, n, g)] for n in (H, 3, H)]
    assert layer.calls == [x for _ in range(8) for c in per_call for x in c]


@pytest.mark.parametrize("backend", ["SLIDING_TILE_ATTN", "VIDEO_SPARSE_ATTN"])
def test_backends_not_known_per_head_run_whole_with_one_log_line(patched, caplog, backend):
    layer = LocalAttention(backend)
    want = run("view", dense_cache, layer)
    layer.calls.clear()
    with caplog.at_level(logging.INFO, logger="pagedqvg"):
        got = run("heads", dense_cache, layer, 1)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert layer.calls == [H, 3, H] * 8  # whole calls
    lines = [r.getMessage() for r in caplog.records if "running the call whole" in r.getMessage()]
    assert len(lines) == 1 and f"backend {backend} is not known" in lines[0], lines


def test_gqa_queries_run_whole(patched):
    layer = LocalAttention()
    attn.set_attention_mode("heads")
    hg.set_head_group_size(1)
    cache = dense_cache()
    q, kw = next(calls(heads_of_query=2 * H))
    view = cache.update_and_get_attention_kv(**kw)
    assert hg.fallback_reason(layer, q, H) == f"query of shape {tuple(q.shape)} has other heads than the view's 6 (GQA)"
    with pytest.raises(RuntimeError):  # the original (SDPA without enable_gqa) refuses 12 query heads over 6
        layer.forward(q, view.k, view.v)
    assert layer.calls == [2 * H]  # reached the original once, whole


def test_autotune_pending_on_a_call_it_would_time_runs_whole(patched, monkeypatch):
    """While SGLang's autotune waits (its `tuning_forward` is the backend's forward), a call of at least
    `AUTOTUNE_MIN_NUMEL` query elements runs whole, so the autotune times the whole call as in mode view; smaller
    calls (which it would not time) and calls after it chose run by groups."""
    layer = LocalAttention()

    def tuning_forward(*args, **kwargs):
        return None

    layer.attn_impl = types.SimpleNamespace(forward=tuning_forward)
    monkeypatch.setattr(hg, "AUTOTUNE_MIN_NUMEL", CHUNK * H * D)  # the whole call's query: tuned
    attn.set_attention_mode("heads")
    hg.set_head_group_size(2)
    cache = dense_cache()
    seq = list(calls())
    for q, kw in seq[:2]:
        view = cache.update_and_get_attention_kv(**kw)
        layer.forward(q, view.k, view.v)
    assert layer.calls == [H, 2, 1]  # whole (>= threshold, pending); the 3-head slice is below it: groups
    layer.attn_impl = types.SimpleNamespace(forward=lambda *a: None)  # the autotune chose and stepped aside
    layer.calls.clear()
    q, kw = seq[2]
    view = cache.update_and_get_attention_kv(**kw)
    layer.forward(q, view.k, view.v)
    assert layer.calls == [2, 2, 2]


def test_head_group_variable():
    assert hg.head_group_size_from_env({}) is None
    assert hg.head_group_size_from_env({"PAGEDQVG_ATTENTION_HEAD_GROUPS": " auto "}) is None
    assert hg.head_group_size_from_env({"PAGEDQVG_ATTENTION_HEAD_GROUPS": "10"}) == 10
    for bad in ("0", "-2", "1.5", "ten"):
        with pytest.raises(CacheConfigError, match=rf"PAGEDQVG_ATTENTION_HEAD_GROUPS='{bad}' is not a group size"):
            hg.head_group_size_from_env({"PAGEDQVG_ATTENTION_HEAD_GROUPS": bad})
    assert attn.attention_mode_from_env({"PAGEDQVG_ATTENTION": "Heads"}) == "heads"
    env = {"PAGEDQVG_BUDGET": "1GiB", "PAGEDQVG_ATTENTION": "heads"}
    settings = settings_from_env(env)
    assert settings.attention == "heads" and "by head groups (PAGEDQVG_ATTENTION=heads)" in settings.describe()
    with pytest.raises(PluginConfigError, match=r"PAGEDQVG_ATTENTION_HEAD_GROUPS='0' is not a group size"):
        settings_from_env({**env, "PAGEDQVG_ATTENTION_HEAD_GROUPS": "0"})
    with pytest.raises(CacheConfigError, match=r"head group size 0; valid: an int >= 1"):
        hg.set_head_group_size(0)


def test_the_group_size_is_clamped_to_the_calls_heads(patched):
    layer = LocalAttention()
    run("heads", dense_cache, layer, 10)
    assert layer.calls == [H, 3, H] * 8  # groups of 10 over 6 (or 3) heads: one group each


def test_default_allowlist_is_data_and_proven_here(patched):
    """`heads` may be the default only on allowlisted (backend, device, torch version) entries; the CPU SDPA entry
    for the running torch is proven bit-identical by `test_heads_mode_equals_view_mode_bit_for_bit` (and again
    here: one group per head, int2)."""
    assert all(isinstance(e, tuple) and len(e) == 3 for e in hg.HEADS_DEFAULT_ALLOWLIST)
    assert hg.heads_is_default("TORCH_SDPA", "cpu", "2.13.0+cpu")
    assert hg.heads_is_default("TORCH_SDPA", "cpu", "2.13")
    assert not hg.heads_is_default("TORCH_SDPA", "cpu", "2.130.0")
    assert not hg.heads_is_default("TORCH_SDPA", "cuda", "2.13.0")  # no GPU measurement yet
    assert not hg.heads_is_default("FA", "cuda", "2.13.0")
    if hg.heads_is_default("TORCH_SDPA", "cpu", torch.__version__):
        layer = LocalAttention()
        want = run("view", packed_cache, layer)
        got = run("heads", packed_cache, layer, 1)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_the_default_decides_by_backend_device_and_torch_version():
    """`default_attention` (what `PAGEDQVG_ATTENTION` unset runs a call in) from its inputs alone: heads exactly for
    allowlisted triples (version by prefix), view with the reason for every other backend, device or version."""
    assert hg.HEADS_DEFAULT_ALLOWLIST == (("TORCH_SDPA", "cpu", "2.13"),)
    entries = "TORCH_SDPA/cpu/2.13"
    mode, why = hg.default_attention("TORCH_SDPA", "cpu", "2.13.0+cpu")
    assert mode == "heads" and why.startswith("backend TORCH_SDPA on cpu, torch 2.13.0+cpu is on the heads allowlist")
    assert f"at most {hg.HEADS_DEFAULT_MARGIN}x view's time" in why
    assert hg.default_attention("TORCH_SDPA", "cpu", "2.13.7")[0] == "heads"
    for backend, device, version in [("TORCH_SDPA", "cpu", "2.14.0"), ("TORCH_SDPA", "cpu", "2.1"),
                                     ("TORCH_SDPA", "cpu", "2.130.0"), ("TORCH_SDPA", "cuda", "2.13.0"),
                                     ("FA3", "cuda", "2.13.0"), ("FA", "cpu", "2.13.0"), (None, "cpu", "2.13.0"),
                                     ("SLIDING_TILE_ATTN", "cpu", "2.13.0")]:  # fmt: skip
        mode, why = hg.default_attention(backend, device, version)
        assert mode == "view", (backend, device, version)
        assert why == f"backend {backend} on {device}, torch {version} is not on the heads allowlist ({entries})"
    assert hg.heads_may_default("cpu", "2.13.0+cpu") and hg.heads_may_default("cpu", "2.13")
    assert not hg.heads_may_default("cuda", "2.13.0") and not hg.heads_may_default("cpu", "2.12.1")
    assert 1.0 < hg.HEADS_DEFAULT_MARGIN <= 1.05


@pytest.mark.parametrize("make", [dense_cache, packed_cache], ids=["quant-off", "int2"])
def test_the_default_runs_heads_for_an_allowlisted_backend_and_view_otherwise(patched, caplog, make):
    """Mode auto through the wrapped `LocalAttention.forward`: SGLang's SDPA backend on CPU runs by head groups
    where the running torch is allowlisted, another backend (FA) runs whole over the built view; both outputs are
    mode view's bit for bit; one log line per decision, however many calls."""
    here = hg.heads_is_default("TORCH_SDPA", "cpu", torch.__version__)
    layer = LocalAttention()
    want = run("view", make, layer)
    for backend, heads in (("TORCH_SDPA", here), ("FA", False)):
        layer = LocalAttention(backend)
        integration().heads_said.clear()
        with caplog.at_level(logging.INFO, logger="pagedqvg"):
            caplog.clear()
            got = run("auto", make, layer, 1)
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            assert torch.equal(a, b), (backend, i)
        assert layer.calls == ([1] * (H + 3 + H) * 8 if heads else [H, 3, H] * 8), backend
        lines = [r.getMessage() for r in caplog.records if "attention default" in r.getMessage()]
        mode = "heads" if heads else "view"
        assert len(lines) == 1 and f"mode {mode}: backend {backend} on cpu, torch {torch.__version__}" in lines[0]
        assert not any("running the call whole" in r.getMessage() for r in caplog.records)


def test_the_default_in_bf16_equals_view_bit_for_bit(patched):
    """bf16 cache and queries: the default (heads by groups of 2 where allowlisted) gives mode view's output."""
    layer = LocalAttention()
    bf16 = lambda: dense_cache(torch.bfloat16)  # noqa: E731
    want = run("view", bf16, layer, dtype=torch.bfloat16)
    layer.calls.clear()
    got = run("auto", bf16, layer, 2, dtype=torch.bfloat16)
    assert all(a.dtype == torch.bfloat16 and torch.equal(a, b) for a, b in zip(got, want, strict=True))
    if hg.heads_is_default("TORCH_SDPA", "cpu", torch.__version__):
        assert layer.calls == [2, 2, 2, 2, 1, 2, 2, 2] * 8  # 6 heads in 3 groups, the 3-head slice in 2, 6 in 3


def test_an_explicit_view_wins_over_the_allowlist(patched, caplog):
    """PAGEDQVG_ATTENTION=view: every call is mode view's (a real view tensor, one original call over every head),
    even for an allowlisted backend; no default line."""
    layer = LocalAttention()
    with caplog.at_level(logging.INFO, logger="pagedqvg"):
        attn.set_attention_mode(attn.attention_mode_from_env({"PAGEDQVG_ATTENTION": "view"}))
        hg.set_head_group_size(1)
        cache = dense_cache()
        for q, c in calls():
            view = cache.update_and_get_attention_kv(**c)
            assert not isinstance(view.k, attn.PagesKV)
            layer.forward(q, view.k, view.v)
    assert layer.calls == [H, 3, H] * 8
    assert not [r for r in caplog.records if "attention" in r.getMessage()]


def test_the_default_defers_a_view_only_where_an_entry_could_apply(patched, caplog):
    """In mode auto a cache call defers its view only where some allowlist entry is for the cache's device type and
    the running torch; elsewhere (a device without an entry) it is mode view's call, and the log says why once."""
    attn.set_attention_mode("auto")
    on_cpu = types.SimpleNamespace(device=torch.device("cpu"))
    assert attn.defers_view(on_cpu) == hg.heads_may_default("cpu", torch.__version__)
    with caplog.at_level(logging.INFO, logger="pagedqvg"):
        for _ in range(3):
            assert attn.defers_view(types.SimpleNamespace(device=torch.device("meta"))) is False
    lines = [r.getMessage() for r in caplog.records if "attention default" in r.getMessage()]
    assert lines == [f"pagedqvg: attention default (PAGEDQVG_ATTENTION unset): mode view: no heads allowlist entry is "
                     f"for meta, torch {torch.__version__}"]  # fmt: skip
    for mode, deferred in (("view", False), ("pages", True), ("heads", True)):
        attn.set_attention_mode(mode)
        assert attn.defers_view(types.SimpleNamespace(device=torch.device("meta"))) is deferred


def test_the_plugin_default_is_auto():
    """PAGEDQVG_ATTENTION unset or empty: mode auto (its describe() text); PAGEDQVG_ATTENTION_HEAD_GROUPS is checked
    with it (it applies where the default runs heads); an explicit view is view."""
    base = {"PAGEDQVG_BUDGET": "1GiB"}
    settings = settings_from_env(base)
    assert settings.attention == "auto" and "by head groups where the backend is allowlisted" in settings.describe()
    assert settings_from_env({**base, "PAGEDQVG_ATTENTION": "view"}).attention == "view"
    assert "(PAGEDQVG_ATTENTION=view)" in settings_from_env({**base, "PAGEDQVG_ATTENTION": "view"}).describe()
    assert settings_from_env({**base, "PAGEDQVG_ATTENTION": "AUTO"}).attention == "auto"
    with pytest.raises(PluginConfigError, match=r"PAGEDQVG_ATTENTION_HEAD_GROUPS='x' is not a group size"):
        settings_from_env({**base, "PAGEDQVG_ATTENTION_HEAD_GROUPS": "x"})
    with pytest.raises(CacheConfigError, match=r"PAGEDQVG_ATTENTION='fast'.*valid: view or pages or heads or auto"):
        attn.attention_mode_from_env({"PAGEDQVG_ATTENTION": "fast"})


@pytest.mark.parametrize("mode", ["heads", "auto"])
def test_a_repeated_heads_call_reads_nothing_back(patched, monkeypatch, production, mode):
    """A denoise step's repeated call in mode heads (pending view, then LocalAttention per group): no read of tensor
    data back to the host, and the output of the first call again."""
    from test_repeated_call import no_host_reads

    layer = LocalAttention()
    attn.set_attention_mode(mode)
    hg.set_head_group_size(2)
    cache = packed_cache()
    seq = list(calls())[:7]
    for q, kw in seq:
        view = cache.update_and_get_attention_kv(**kw)
        first = layer.forward(q, view.k, view.v)
    q, kw = seq[-1]
    reads = no_host_reads(monkeypatch)
    view = cache.update_and_get_attention_kv(**kw)
    again = layer.forward(q, view.k, view.v)
    monkeypatch.undo()
    assert reads == [], reads
    assert torch.equal(again, first)
