"""pagedqvg.integrations.sglang without SGLang: the SGLang-signature classes against the dense reference, their
surface and errors, quant_args mapping, and install()/uninstall() against a stand-in of SGLang's module layout.
(SGLang's own unit tests run against install() in .ci/sglang_suite.sh.)"""

from __future__ import annotations

import random
import subprocess
import sys
import types
from dataclasses import dataclass

import pytest
import torch
from dense_reference import DenseReferenceCache
from helpers import cache_state, same

from pagedqvg import BlockPool, CacheConfigError, IntegrationError, QuantConfig, SequencingError
from pagedqvg.allocator.pool import debug_state
from pagedqvg.integrations.sglang import integration as integ
from pagedqvg.integrations.sglang.integration import (
    PagedCausalSelfAttentionKVCache,
    PagedQVGPackedCausalKVCache,
    quant_config_from_sglang,
)
from pagedqvg.integrations.sglang.versions import CURRENT, targets_for

#: SGLang's modules from versions.py's table (what install() imports and patches).
QVG_MODULE = targets_for(CURRENT, "cache_class")[1].module
STAGE_MODULE = targets_for(CURRENT, "allocate")[0].module
LINGBOT_STAGE_MODULE = targets_for(CURRENT, "allocate_lingbot")[0].module

B, H, D = 1, 4, 8


def pool(kib: int = 512) -> BlockPool:
    return BlockPool(capacity_bytes=kib * 1024, page_bytes=1024)


def dense_cache(p, C=16, dtype=torch.float32, fill=0.0, **kw):
    buf = torch.full((B, C, H, D), fill, dtype=dtype)
    return PagedCausalSelfAttentionKVCache(
        buf,
        buf.clone(),
        torch.zeros(1, dtype=torch.long),
        torch.zeros(1, dtype=torch.long),
        pool=p,
        **kw,
    )


def kv(n, heads=H, dtype=torch.float32, gen=None):
    return torch.randn(B, n, heads, D, generator=gen).to(dtype), torch.randn(B, n, heads, D, generator=gen).to(dtype)


def assert_view_equal(view, ref):
    assert torch.equal(view.k, ref.k) and torch.equal(view.v, ref.v)
    got = (view.local_start_index, view.local_end_index, view.visible_local_end, view.visible_global_end)
    want = (ref.local_start_index, ref.local_end_index, ref.visible_local_end, ref.visible_global_end)
    assert got == want


def assert_buffers_equal(cache, ref):
    """`cache.k` / `cache.v` equal the reference's buffers on the filled slots [0, L)."""
    L = ref.L
    k, v = cache.k, cache.v
    assert k.shape == (B, cache.cache_size, H, D)
    assert torch.equal(k[:, :L], ref.k[:, :L]) and torch.equal(v[:, :L], ref.v[:, :L])


def assert_cursors(cache, ref):
    assert (cache.global_end_index_int, cache.local_end_index_int) == (ref.G, ref.L)
    assert (int(cache.global_end_index.item()), int(cache.local_end_index.item())) == (ref.G, ref.L)


# ------------------------------------------------------------------------------------------- contract vs reference
@pytest.mark.parametrize("seed", range(6))
def test_random_sessions_equal_the_dense_reference(seed):
    """Advances, denoise-step rewrites, pins, settable sink / window, recent windows, head slices and float16 input
    into a float32 cache (cast as the dense cache casts): every view, cursor and materialized buffer equal."""
    rnd = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    C = rnd.choice([12, 16, 20])
    S = rnd.choice([0, 2, 4])
    GS = rnd.choice([0, 0, 2])
    grow = rnd.random() < 0.25
    cache = dense_cache(pool(), C=C, sink_tokens=S, global_sink_tokens=GS, allow_growth=grow)
    ref = DenseReferenceCache(B, C, H, D, sink_tokens=S, global_sink_tokens=GS, allow_growth=grow)
    assert cache.global_end_index_int is None  # as the dense cache: set at the first call
    for _ in range(30):
        op = rnd.random()
        if op < 0.12:
            n = rnd.randint(0, 4)
            cache.pin_current_chunk(n)
            ref.pin_current_chunk(n)
            assert (cache.pinned_start, cache.pinned_len) == (ref.P, ref.PL)
            continue
        if op < 0.18:
            s = rnd.choice([0, 2, 3])
            cache.sink_tokens = s
            ref.S = s
            continue
        if op < 0.24:
            w = rnd.randint(4, cache.cache_size)
            cache.attention_window_size = w
            ref.W = w
            continue
        n = rnd.randint(1, 4)
        rewrite = ref.G > 0 and rnd.random() < 0.4
        start = max(0, ref.G - n) if rewrite else ref.G
        heads = rnd.choice([H, H, 2])
        h0 = rnd.choice([0, 2]) if heads != H else None
        r = rnd.choice([None, None, 0, 3])
        key, value = kv(n, heads, gen=gen)
        if rnd.random() < 0.2:
            key, value = key.half(), value.half()
        try:
            want = ref.update_and_get_attention_kv(key.float(), value.float(), start, h0, r)
        except (SequencingError, CacheConfigError, ValueError) as exc:
            before = cache_state(cache)
            with pytest.raises(type(exc)):
                cache.update_and_get_attention_kv(
                    key=key, value=value, current_chunk_start=start, cache_head_start=h0, recent_window_tokens=r
                )
            same(before, cache_state(cache))
            continue
        got = cache.update_and_get_attention_kv(
            key=key, value=value, current_chunk_start=start, cache_head_start=h0, recent_window_tokens=r
        )
        assert_view_equal(got, want)
        assert_cursors(cache, ref)
        assert (cache.cache_size, cache.attention_window_size) == (ref.C, ref.W)
        if heads == H:
            assert_buffers_equal(cache, ref)
    cache.reset_indices()
    ref.reset_indices()
    assert_cursors(cache, ref)
    assert (cache.pinned_start, cache.pinned_len) == (-1, 0)


def test_constructed_with_nonzero_cursors_continues_like_the_dense_cache():
    """global_end_index_int=7, local_end_index_int=4: slots [0, 4) hold tokens [3, 7), never written (zeros); an
    append at 7 rolls them exactly as the dense cache, and a rewrite of token 5 works."""
    p = pool()
    buf = torch.zeros(B, 6, H, D)
    g_t, l_t = torch.tensor([7]), torch.tensor([4])
    cache = PagedCausalSelfAttentionKVCache(buf, buf.clone(), g_t, l_t, 7, 4, sink_tokens=1, pool=p)
    assert cache.global_end_index is g_t and cache.local_end_index is l_t
    ref = DenseReferenceCache(B, 6, H, D, sink_tokens=1)
    ref.G, ref.L = 7, 4
    ref.slot_global = [3, 4, 5, 6, None, None]
    assert torch.equal(cache.k, torch.zeros(B, 6, H, D))
    gen = torch.Generator().manual_seed(3)
    for start, n in ((7, 3), (8, 2), (10, 2), (11, 1)):
        key, value = kv(n, gen=gen)
        assert_view_equal(
            cache.update_and_get_attention_kv(key=key, value=value, current_chunk_start=start),
            ref.update_and_get_attention_kv(key, value, start),
        )
        assert_cursors(cache, ref)
        assert_buffers_equal(cache, ref)


def test_constructed_with_tensor_cursors_only():
    """Ints None: the tensors are the truth (as the dense cache's first _read_indices); both forms after a call."""
    buf = torch.zeros(B, 8, H, D)
    cache = PagedCausalSelfAttentionKVCache(buf, buf, torch.tensor([5]), torch.tensor([2]), pool=pool())
    assert cache.global_end_index_int is None
    key, value = kv(2)
    view = cache.update_and_get_attention_kv(key=key, value=value, current_chunk_start=5)
    assert (view.local_start_index, view.local_end_index, view.visible_global_end) == (2, 4, 7)
    assert (cache.global_end_index_int, cache.local_end_index_int) == (7, 4)
    assert torch.equal(view.k[:, 2:], key) and torch.equal(view.k[:, :2], torch.zeros(B, 2, H, D))


def test_inconsistent_cursors_are_kept_until_reset():
    """A local end past cache_size (SGLang's reset test builds one) constructs; using it names the values; a
    reset makes it a fresh cache."""
    buf = torch.empty(1, 1, 1, 1)
    cache = PagedCausalSelfAttentionKVCache(buf, buf, torch.tensor([7]), torch.tensor([3]), 7, 3, pool=pool())
    with pytest.raises(CacheConfigError, match=r"global_end_index=7, local_end_index=3.*cache_size=1.*reset_indices"):
        cache.update_and_get_attention_kv(
            key=torch.ones(1, 1, 1, 1), value=torch.ones(1, 1, 1, 1), current_chunk_start=7
        )
    cache.reset_indices()
    assert (cache.global_end_index_int, int(cache.local_end_index.item())) == (0, 0)
    view = cache.update_and_get_attention_kv(
        key=torch.ones(1, 1, 1, 1), value=torch.ones(1, 1, 1, 1), current_chunk_start=0
    )
    assert view.k.flatten().tolist() == [1.0]


def test_uniform_buffer_is_the_fill_of_never_written_heads():
    """SGLang's head-slice test: a buffer of 99 shows 99 in the heads a sliced write never wrote."""
    buf = torch.full((1, 4, 4, 1), 99.0)
    cache = PagedCausalSelfAttentionKVCache(
        buf, buf * 10, torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long), 0, 0, pool=pool()
    )
    key = torch.tensor([[[[1.0], [2.0]], [[3.0], [4.0]]]])
    view = cache.update_and_get_attention_kv(key=key, value=key * 10, current_chunk_start=0, cache_head_start=1)
    assert view.k.flatten().tolist() == [1.0, 2.0, 3.0, 4.0]
    assert cache.k[0, :2, :, 0].tolist() == [[99.0, 1.0, 2.0, 99.0], [99.0, 3.0, 4.0, 99.0]]
    assert cache.v[0, :2, 0, 0].tolist() == [990.0, 990.0]
    assert cache.k[0, 2:, :, 0].eq(99.0).all()  # slots past the local end: the fill too


def test_k_and_v_are_read_only_debugging_views():
    cache = dense_cache(pool())
    key, value = kv(3)
    cache.update_and_get_attention_kv(key=key, value=value, current_chunk_start=0)
    with pytest.raises(AttributeError):
        cache.k = torch.zeros(B, 16, H, D)
    cache.k[:, :3] = 5.0  # a copy: the cache does not change
    assert torch.equal(cache.k[:, :3], key)


def test_sglang_view_class_used_when_its_module_is_loaded(monkeypatch):
    @dataclass(slots=True)
    class View:
        k: torch.Tensor
        v: torch.Tensor
        local_start_index: int
        local_end_index: int
        visible_local_end: int
        visible_global_end: int

    module = types.ModuleType(integ.KVCACHE_MODULE)
    module.CausalAttentionKVView = View
    monkeypatch.setitem(sys.modules, integ.KVCACHE_MODULE, module)
    key, value = kv(2)
    view = dense_cache(pool()).update_and_get_attention_kv(key=key, value=value, current_chunk_start=0)
    assert type(view) is View and torch.equal(view.k, key)


def test_debug_name_appears_in_call_errors():
    cache = dense_cache(pool(), name="layer7")
    key, value = kv(2)
    with pytest.raises(SequencingError, match=r"block 7 self-attn \(layer7\).*start=5"):
        cache.update_and_get_attention_kv(key=key, value=value, current_chunk_start=5, debug_name="block 7 self-attn")
    assert cache.debug_name == "layer7"


# ------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    ("attr", "value", "pattern"),
    [
        ("sink_tokens", -1, r"sink_tokens must be an int >= 0, got -1"),
        ("sink_tokens", 1.5, r"sink_tokens must be an int >= 0, got 1.5"),
        ("attention_window_size", 0, r"attention_window_size must be an int >= 1 \(slots\), got 0"),
        ("attention_window_size", True, r"attention_window_size must be an int >= 1"),
        ("allow_growth", "yes", r"allow_growth must be a bool, got 'yes'"),
    ],
)
def test_bad_settings_are_refused_and_change_nothing(attr, value, pattern):
    cache = dense_cache(pool(), sink_tokens=2)
    key, val = kv(3)
    cache.update_and_get_attention_kv(key=key, value=val, current_chunk_start=0)
    before = cache_state(cache)
    kept = (cache.sink_tokens, cache.attention_window_size, cache.allow_growth)
    with pytest.raises(CacheConfigError, match=pattern):
        setattr(cache, attr, value)
    same(before, cache_state(cache))
    assert (cache.sink_tokens, cache.attention_window_size, cache.allow_growth) == kept


def _ctor_case(name):
    z = torch.zeros(B, 8, H, D)
    i0, i1 = torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long)
    cases = {
        "k 3-d": ((torch.zeros(8, H, D), z, i0, i1), {}, r"k must be a \[batch, cache_size, heads, head_dim\]"),
        "v differs": ((z, torch.zeros(B, 9, H, D), i0, i1), {}, r"v \(\(1, 9, 4, 8\).*differs from k"),
        "int dtype": ((z.long(), z.long(), i0, i1), {}, r"k dtype torch.int64 is not supported"),
        "float cursor": ((z, z, torch.zeros(1), i1), {}, r"global_end_index must be a 1-element integer tensor"),
        "same cursor": ((z, z, i0, i0), {}, r"two different tensors"),
        "negative int": ((z, z, i0, i1, -1, 0), {}, r"global_end_index_int must be None or an int >= 0, got -1"),
        "pin": ((z, z, i0, i1), {"pinned_start": -2}, r"pinned_start=-2"),
        "pin past end": (
            (z, z, torch.tensor([4]), torch.tensor([4]), 4, 4),
            {"pinned_start": 2, "pinned_len": 3},
            r"pinned_start=2 \+ pinned_len=3 exceeds local_end_index=4",
        ),
        "cache_size": ((z, z, i0, i1), {"cache_size": -3}, r"cache_size must be an int >= 0 \(0 = k.shape\[1\]\)"),
        "local past global": (
            (z, z, torch.tensor([2]), torch.tensor([3]), 2, 3),
            {},
            r"global_end_index=2, local_end_index=3 \(valid: 0 <= local <= global\)",
        ),
    }
    return cases[name]


@pytest.mark.parametrize(
    "case",
    [
        "k 3-d",
        "v differs",
        "int dtype",
        "float cursor",
        "same cursor",
        "negative int",
        "pin",
        "pin past end",
        "cache_size",
    ],
)
def test_bad_construction_is_refused_and_leaves_the_pool_unchanged(case):
    args, kw, pattern = _ctor_case(case)
    p = pool()
    before = (p.stats(), debug_state(p), p.arena.clone())
    with pytest.raises(CacheConfigError, match=pattern):
        PagedCausalSelfAttentionKVCache(*args, pool=p, **kw)
    after = (p.stats(), debug_state(p), p.arena.clone())
    assert before[:2] == after[:2] and torch.equal(before[2], after[2])


# ------------------------------------------------------------------------------------------- quantization
def test_quant_off_accepts_any_head_dim():
    for head_dim in (1, 4, 11):
        assert QuantConfig.from_dict({"kv_cache_quant": "off"}).validate(head_dim=head_dim).bits is None
    assert quant_config_from_sglang(types.SimpleNamespace(**_qargs(bits=None)), 4) is None


def _qargs(**kw):
    base = dict(
        bits=4,
        centroids=128,
        block_size=64,
        stages=1,
        kmeans_iters=2,
        asymmetric=False,
        keep_recent_chunks=1,
        sink=True,
        sink_keep_chunks=0,
    )
    base.update(kw)
    return base


def test_quant_args_map_to_quantconfig():
    cfg = quant_config_from_sglang(types.SimpleNamespace(**_qargs(bits=2, stages=3, sink=0)), 128)
    assert (cfg.bits, cfg.stages, cfg.sink, cfg.block_size, cfg.centroids) == (2, 3, False, 64, 128)
    # A block larger than the head: one scale per token-head, as SGLang's QVG cache accepts it.
    assert quant_config_from_sglang(types.SimpleNamespace(**_qargs()), 4).block_size == 4
    assert quant_config_from_sglang({"kv_cache_quant": "int4"}, 128).bits == 4


@pytest.mark.parametrize(
    ("kw", "head_dim", "pattern"),
    [
        ({"centroids": 0}, 128, r"--kv-cache-quant-centroids \(QuantConfig.centroids\)=0"),
        ({"bits": 4}, 11, r"head_dim=11 at bits=4.*--kv-cache-quant picks bits"),
        (
            {"block_size": 48},
            128,
            r"--kv-cache-quant-block-size \(QuantConfig.block_size\)=48 does not divide head_dim=128",
        ),
    ],
)
def test_quant_args_pagedqvg_cannot_pack_name_the_flag(kw, head_dim, pattern):
    with pytest.raises(CacheConfigError, match=pattern):
        quant_config_from_sglang(types.SimpleNamespace(**_qargs(**kw)), head_dim)


def test_qvg_class_with_quant_on_supports_global_sink_pin_and_growth():
    """SGLang's QVG cache refuses these; pagedqvg's selects the dense contract's slots (values of packed chunks
    differ by the quantization error only)."""
    p = BlockPool(capacity_bytes=8 << 20, page_bytes=4096)
    args = types.SimpleNamespace(**_qargs(bits=4, centroids=4, block_size=8, keep_recent_chunks=0))
    cache = PagedQVGPackedCausalKVCache(
        batch_size=B,
        cache_size=16,
        num_heads=H,
        head_dim=D,
        dtype=torch.float32,
        device="cpu",
        global_end_index=torch.zeros(1, dtype=torch.long),
        local_end_index=torch.zeros(1, dtype=torch.long),
        sink_tokens=4,
        quant_args=args,
        global_sink_tokens=2,
        allow_growth=True,
        pool=p,
    )
    ref = DenseReferenceCache(B, 16, H, D, sink_tokens=4, global_sink_tokens=2, allow_growth=True)
    gen = torch.Generator().manual_seed(0)
    for chunk in range(6):
        key, value = kv(4, gen=gen)
        for _ in range(2):
            got = cache.update_and_get_attention_kv(key=key, value=value, current_chunk_start=4 * chunk)
            want = ref.update_and_get_attention_kv(key, value, 4 * chunk)
        assert got.k.shape == want.k.shape and got.visible_local_end == want.visible_local_end
        assert (got.k - want.k).abs().max() < 1.0  # int4 error of unit-normal data
        if chunk == 2:
            cache.pin_current_chunk(4)
            ref.pin_current_chunk(4)
    assert cache.cache_size == ref.C > 16  # grew
    assert any(kind == "packed" for *_, kind in cache.last_view_sources())
    assert cache.num_heads == H and cache.q is args


def test_qvg_class_cursor_forms_follow_sglangs_qvg_cache():
    """With use_int_indices only the host ints move (SGLang's QVG test: no device updates); reset zeroes both."""
    g_t, l_t = torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long)
    cache = PagedQVGPackedCausalKVCache(
        batch_size=1,
        cache_size=16,
        num_heads=2,
        head_dim=4,
        dtype=torch.float32,
        device="cpu",
        global_end_index=g_t,
        local_end_index=l_t,
        use_int_indices=True,
        quant_args=types.SimpleNamespace(**_qargs(bits=None)),
        pool=pool(),
    )
    cache.update_and_get_attention_kv(key=torch.ones(1, 4, 2, 4), value=torch.ones(1, 4, 2, 4), current_chunk_start=0)
    assert (cache.global_end_index_int, cache.local_end_index_int) == (4, 4)
    assert (int(g_t.item()), int(l_t.item())) == (0, 0)
    cache.reset_indices()
    assert (cache.global_end_index_int, cache.local_end_index_int) == (0, 0)


# ------------------------------------------------------------------------------------------- install / uninstall
class _DenseStandIn:
    """SGLang's class as far as install() looks: a class at the right module path."""

    def __init__(self, *args, **kwargs):
        self.args, self.kwargs = args, kwargs


class _QVGStandIn(_DenseStandIn):
    pass


@pytest.fixture
def fake_sglang(monkeypatch):
    """SGLang 0.5.23's module layout with stand-in classes (the modules install() imports and patches)."""
    names = [
        "sglang",
        "sglang.multimodal_gen",
        "sglang.multimodal_gen.runtime",
        "sglang.multimodal_gen.runtime.layers",
        "sglang.multimodal_gen.runtime.layers.kvcache",
        integ.KVCACHE_MODULE,
        QVG_MODULE,
        STAGE_MODULE,
        LINGBOT_STAGE_MODULE,
    ]
    mods = {}
    for name in names:
        mods[name] = types.ModuleType(name)
        mods[name].__path__ = []
        monkeypatch.setitem(sys.modules, name, mods[name])
    for name in integ.BINDING_MODULES:
        if name not in mods:
            monkeypatch.setitem(sys.modules, name, None)  # not importable (as a model module missing its deps)

    @dataclass(slots=True)
    class View:
        k: torch.Tensor
        v: torch.Tensor
        local_start_index: int
        local_end_index: int
        visible_local_end: int
        visible_global_end: int

    kvmod = mods[integ.KVCACHE_MODULE]
    kvmod.CausalAttentionKVView = View
    kvmod.CausalSelfAttentionKVCache = _DenseStandIn
    mods["sglang.multimodal_gen.runtime.layers.kvcache"].CausalSelfAttentionKVCache = _DenseStandIn
    mods[QVG_MODULE].QVGPackedCausalKVCache = _QVGStandIn

    def original_allocate(  # SGLang 0.5.23's signature (the hooks refuse another)
        self, batch_size, kv_cache_size, num_attention_heads, attention_head_dim, dtype, device,
        use_int_indices=False, sink_tokens=0, global_sink_tokens=0, attention_window_size=None, allow_growth=False,
    ):  # fmt: skip
        return ["dense buffers"]

    def forward(self, batch, server_args):  # SGLang's: the stage keeps the caches it allocates
        self.causal_kv_cache = self._allocate_causal_kv_cache(
            batch_size=1, kv_cache_size=8, num_attention_heads=1, attention_head_dim=4, dtype=torch.float32,
            device="cpu",
        )  # fmt: skip
        kv = torch.ones(1, 2, 1, 4)
        self.causal_kv_cache[0].update_and_get_attention_kv(key=kv, value=kv, current_chunk_start=0)
        return self.causal_kv_cache[0].pool

    stage = type("CausalDMDDenoisingStage", (), {"_allocate_causal_kv_cache": original_allocate, "forward": forward})
    stage.__module__ = STAGE_MODULE
    mods[STAGE_MODULE].CausalDMDDenoisingStage = stage
    mods[STAGE_MODULE].CausalSelfAttentionKVCache = _DenseStandIn
    mods[STAGE_MODULE].QVGPackedCausalKVCache = _QVGStandIn
    lingbot = type("LingBotWorldCausalDMDDenoisingStage", (stage,), {"_allocate_causal_kv_cache": original_allocate})
    lingbot.__module__ = LINGBOT_STAGE_MODULE
    mods[LINGBOT_STAGE_MODULE].LingBotWorldCausalDMDDenoisingStage = lingbot
    mods[LINGBOT_STAGE_MODULE].QVGPackedCausalKVCache = _QVGStandIn
    yield types.SimpleNamespace(
        mods=mods, stage=stage, lingbot=lingbot, View=View, allocate=original_allocate, forward=forward
    )
    integ.uninstall()


def test_install_patches_every_binding_and_the_allocation(fake_sglang):
    patched = integ.install(budget_bytes=16 << 20)
    assert set(patched) == {
        f"{STAGE_MODULE}.CausalDMDDenoisingStage._allocate_causal_kv_cache",
        f"{LINGBOT_STAGE_MODULE}.LingBotWorldCausalDMDDenoisingStage._allocate_causal_kv_cache",
        f"{STAGE_MODULE}.CausalDMDDenoisingStage.forward",
        f"{integ.KVCACHE_MODULE}.CausalSelfAttentionKVCache",
        "sglang.multimodal_gen.runtime.layers.kvcache.CausalSelfAttentionKVCache",
        f"{STAGE_MODULE}.CausalSelfAttentionKVCache",
        f"{QVG_MODULE}.QVGPackedCausalKVCache",
        f"{STAGE_MODULE}.QVGPackedCausalKVCache",
        f"{LINGBOT_STAGE_MODULE}.QVGPackedCausalKVCache",
    }
    assert integ.install(budget_bytes=16 << 20) == patched  # idempotent
    mods = fake_sglang.mods
    assert mods[integ.KVCACHE_MODULE].CausalSelfAttentionKVCache is PagedCausalSelfAttentionKVCache
    assert mods[LINGBOT_STAGE_MODULE].QVGPackedCausalKVCache is PagedQVGPackedCausalKVCache

    stage = fake_sglang.stage()
    stage.num_transformer_blocks = 3
    caches = stage._allocate_causal_kv_cache(
        batch_size=1,
        kv_cache_size=12,
        num_attention_heads=2,
        attention_head_dim=4,
        dtype=torch.bfloat16,
        device=torch.device("cpu"),
        use_int_indices=True,
        sink_tokens=3,
        global_sink_tokens=0,
    )
    assert [type(c) for c in caches] == [PagedCausalSelfAttentionKVCache] * 3
    assert len({id(c.pool) for c in caches}) == 1 and caches[0].pool is integ.shared_pool("cpu")
    assert caches[0].pool.page_bytes * caches[0].pool.num_pages <= 16 << 20
    assert (caches[0].cache_size, caches[0].sink_tokens, caches[0].global_end_index_int) == (12, 3, 0)
    view = caches[1].update_and_get_attention_kv(
        key=torch.ones(1, 2, 2, 4, dtype=torch.bfloat16),
        value=torch.ones(1, 2, 2, 4, dtype=torch.bfloat16),
        current_chunk_start=0,
    )
    assert type(view) is fake_sglang.View

    free = integ.shared_pool("cpu").num_free_pages
    pool = stage.forward(None, None)  # one request: the caches written, then closed when forward returns
    assert pool.num_free_pages == free and stage.causal_kv_cache is None

    lingbot = fake_sglang.lingbot()
    lingbot.num_transformer_blocks = 2
    lingbot._kv_quant_args = types.SimpleNamespace(enabled=True, **_qargs(bits=2, block_size=64))
    shared = integ.shared_pool("cpu")
    before = (debug_state(shared), shared.num_free_pages)
    with pytest.raises(CacheConfigError, match=r"need pages of at least 2048 bytes .* pages of 512 bytes \(chosen for"):
        lingbot._allocate_causal_kv_cache(  # 128 fp32 codebook rows of 4 channels: 2 KiB, over the shared 512 B page
            batch_size=1, kv_cache_size=12, num_attention_heads=2, attention_head_dim=4, dtype=torch.float32,
            device="cpu", global_sink_tokens=3, allow_growth=True,
        )  # fmt: skip
    assert (debug_state(shared), shared.num_free_pages) == before
    lingbot._kv_quant_args = types.SimpleNamespace(enabled=True, **_qargs(bits=2, block_size=64, centroids=4))
    q = lingbot._allocate_causal_kv_cache(
        batch_size=1,
        kv_cache_size=12,
        num_attention_heads=2,
        attention_head_dim=4,
        dtype=torch.float32,
        device="cpu",
        global_sink_tokens=3,
        allow_growth=True,
    )
    assert [type(c) for c in q] == [PagedQVGPackedCausalKVCache] * 2
    assert q[0].quant.bits == 2 and q[0].quant.block_size == 4 and q[0].global_sink_tokens == 3
    assert q[0].pool is caches[0].pool

    late = types.ModuleType("sglang.multimodal_gen.late_module")
    late.CausalSelfAttentionKVCache = mods[integ.KVCACHE_MODULE].CausalSelfAttentionKVCache  # bound after install
    sys.modules[late.__name__] = late
    try:
        integ.uninstall()
        assert late.CausalSelfAttentionKVCache is _DenseStandIn
    finally:
        del sys.modules[late.__name__]
    assert mods[integ.KVCACHE_MODULE].CausalSelfAttentionKVCache is _DenseStandIn
    assert mods[STAGE_MODULE].QVGPackedCausalKVCache is _QVGStandIn
    assert fake_sglang.stage.__dict__["_allocate_causal_kv_cache"] is fake_sglang.allocate
    assert fake_sglang.stage.__dict__["forward"] is fake_sglang.forward
    assert integ.installed() == []


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({}, r"install\(\) needs pool=BlockPool\(...\), budget_bytes=N or memory_fraction=F"),
        ({"memory_fraction": 0.5, "budget_bytes": 1 << 20}, r"memory_fraction \(0.5\) or budget_bytes \(1048576\)"),
        ({"memory_fraction": 1.5}, r"memory_fraction must be a number in \(0, 1\], got 1.5"),
        ({"budget_bytes": -5}, r"budget_bytes must be an int > 0 \(bytes\), got -5"),
        ({"pool": "big"}, r"pool must be a pagedqvg.BlockPool or None, got str"),
    ],
)
def test_install_bad_arguments_patch_nothing(fake_sglang, kwargs, pattern):
    with pytest.raises(CacheConfigError, match=pattern):
        integ.install(**kwargs)
    assert integ.installed() == []
    assert fake_sglang.mods[integ.KVCACHE_MODULE].CausalSelfAttentionKVCache is _DenseStandIn


def test_install_without_sglang_is_an_integration_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "sglang", None)
    with pytest.raises(IntegrationError, match=r"SGLang's multimodal_gen is not importable.*sglang==0.5.23"):
        integ.install(budget_bytes=1 << 20)
    assert integ.installed() == []


def test_shared_pool_needs_a_pool_budget_or_fraction(fake_sglang):
    p = pool()
    integ.install(pool=p)
    assert integ.shared_pool("cpu") is p
    integ.uninstall()
    with pytest.raises(CacheConfigError, match=r"no BlockPool for device cpu.*install\(budget_bytes=N\)"):
        integ.shared_pool("cpu")
    integ.install(budget_bytes=100)
    with pytest.raises(CacheConfigError, match=r"budget_bytes=100 gives 100 bytes, below one page of 1048576"):
        integ.shared_pool("cpu")


def test_import_pagedqvg_never_imports_sglang():
    code = (
        "import sys, pagedqvg, pagedqvg.integrations.sglang; "
        "bad = [m for m in sys.modules if m == 'sglang' or m.startswith('sglang.')]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
