"""Hand-computed tests of the dense reference (tests/dense_reference.py) so the oracle itself is trustworthy.

Tokens are encoded so that a view can be decoded back into global positions: the key of global position g written in
pass p is ``g + 1000 * p`` on every element (and value = -key), unless a test says otherwise.
"""

import pytest
import torch
from dense_reference import CacheConfigError, DenseReferenceCache, SequencingError


def chunk(s, n, B=1, H=1, D=2, p=0, dtype=torch.float32):
    g = torch.arange(s, s + n, dtype=torch.float32) + 1000 * p
    k = g.view(1, n, 1, 1).expand(B, n, H, D).to(dtype).contiguous()
    return k, -k


def write(c, s, n, p=0, **kw):
    k, v = chunk(s, n, c.B, kw.pop("Hin", c.H), c.D, p, c.dtype)
    return c.update_and_get_attention_kv(k, v, s, **kw)


def toks(view):
    """Global positions (pass-encoded) of the tokens of a view, read from batch 0, head 0, dim 0."""
    assert torch.equal(view.v, -view.k)
    return [int(x) for x in view.k[0, :, 0, 0].tolist()]


def fields(view):
    return (view.local_start_index, view.local_end_index, view.visible_local_end, view.visible_global_end)


def snapshot(c):
    return (c.G, c.L, c.C, c.W, c.P, c.PL, list(c.slot_global), c.k.clone(), c.v.clone())


def assert_same(a, b):
    assert a[:7] == b[:7]
    assert torch.equal(a[7], b[7]) and torch.equal(a[8], b[8])


# ---------------------------------------------------------------------------------------------- append & roll
def test_append_no_roll():
    c = DenseReferenceCache(1, 8, 1, 2)
    v = write(c, 0, 4)
    assert fields(v) == (0, 4, 4, 4)
    assert toks(v) == [0, 1, 2, 3]
    v = write(c, 4, 4)
    assert fields(v) == (4, 8, 8, 8)
    assert toks(v) == list(range(8))
    assert c.slot_global == list(range(8))
    assert c.E == 0 and not c.last_rolled


def _rolled_cache(**kw):
    c = DenseReferenceCache(1, 8, 1, 2, sink_tokens=2, **kw)
    write(c, 0, 4)
    write(c, 4, 4)
    v = write(c, 8, 3)  # ev = 3, E = 2, rolled = max(0, 8-3-2) = 3: slots [5,8) -> [2,5)
    return c, v


def test_roll_with_sink():
    c, v = _rolled_cache()
    assert c.last_rolled
    assert c.slot_global == [0, 1, 5, 6, 7, 8, 9, 10]
    assert (c.G, c.L) == (11, 8)
    assert fields(v) == (5, 8, 8, 11)
    # GS == 0, not pinned -> plain window [A, L) with W = C -> everything
    assert c.last_branch == "window"
    assert toks(v) == [0, 1, 5, 6, 7, 8, 9, 10]
    # buffer really moved
    assert c.k[0, :, 0, 0].tolist() == [0, 1, 5, 6, 7, 8, 9, 10]


def test_roll_without_sink():
    c = DenseReferenceCache(1, 6, 1, 2)
    write(c, 0, 6)
    v = write(c, 6, 2)  # ev 2, E 0, rolled 4: [2,6) -> [0,4)
    assert c.slot_global == [2, 3, 4, 5, 6, 7]
    assert fields(v) == (4, 6, 6, 8)
    assert toks(v) == [2, 3, 4, 5, 6, 7]
    v = write(c, 8, 6)  # whole cache replaced: ev 6, rolled 0
    assert c.slot_global == list(range(8, 14))
    assert toks(v) == list(range(8, 14))


def test_window_plain():
    c, v = _rolled_cache(attention_window_size=4)
    # A = 4 -> slots [4, 8) = globals 7..10
    assert c.last_branch == "window"
    assert toks(v) == [7, 8, 9, 10]


def test_global_sink_ps_branch():
    c = DenseReferenceCache(1, 8, 1, 2, global_sink_tokens=2, attention_window_size=4)
    write(c, 0, 4)
    v = write(c, 4, 4)
    # L = 8, A = 4, E = 2: ps -> [0,2) + [max(2, 8 - (4 - 2)), 8) = [0,2)+[6,8)
    assert c.last_branch == "ps"
    assert toks(v) == [0, 1, 6, 7]
    v = write(c, 8, 3)  # ev 3, rolled 3: [5,8)->[2,5); new at [5,8)
    assert c.slot_global == [0, 1, 5, 6, 7, 8, 9, 10]
    assert toks(v) == [0, 1, 9, 10]
    # before A > 0 the GS branch falls back to [A, L)
    c2 = DenseReferenceCache(1, 8, 1, 2, global_sink_tokens=2, attention_window_size=4)
    v = write(c2, 0, 3)
    assert c2.last_branch == "window(sinkless)"
    assert toks(v) == [0, 1, 2]


def test_sink_tokens_without_global_sink_do_not_show_in_plain_window():
    # S > 0, GS == 0, not pinned: the view is [A, L) (sink not prepended)
    c = DenseReferenceCache(1, 8, 1, 2, sink_tokens=2, attention_window_size=3)
    write(c, 0, 4)
    v = write(c, 4, 4)
    assert c.last_branch == "window"
    assert toks(v) == [5, 6, 7]


# ---------------------------------------------------------------------------------------------- recent window
def test_recent_window_branches():
    c, _ = _rolled_cache()
    # ls = 5 for the last call; rewrite the same range with various r
    v = write(c, 8, 3, p=1, recent_window_tokens=0)
    # se = min(2, 8) = 2, rs = max(2, 5-0) = 5 -> [0,2) + [5,8)
    assert c.last_branch == "recent+sink"
    assert fields(v) == (5, 8, 8, 11)
    assert toks(v) == [0, 1, 1008, 1009, 1010]
    v = write(c, 8, 3, p=2, recent_window_tokens=1)
    assert toks(v) == [0, 1, 7, 2008, 2009, 2010]
    v = write(c, 8, 3, p=3, recent_window_tokens=3)  # rs = 2 <= se -> [0, L)
    assert c.last_branch == "recent:all"
    assert toks(v) == [0, 1, 5, 6, 7, 3008, 3009, 3010]
    v = write(c, 8, 3, p=4, recent_window_tokens=100)
    assert toks(v) == [0, 1, 5, 6, 7, 4008, 4009, 4010]


def test_recent_window_no_sink_and_pin():
    c = DenseReferenceCache(1, 8, 1, 2)
    write(c, 0, 4)
    v = write(c, 4, 2, recent_window_tokens=1)
    # E = 0: se = 0, rs = max(0, 4-1) = 3 -> [3, 6)
    assert c.last_branch == "recent"
    assert toks(v) == [3, 4, 5]
    # pinned in the middle: S = 2, GS = 0
    c = DenseReferenceCache(1, 8, 1, 2, sink_tokens=2)
    write(c, 0, 2)
    write(c, 2, 2)
    c.pin_current_chunk(2)  # P = 2, PL = 2, P != GS -> E = GS = 0
    assert (c.P, c.PL, c.E) == (2, 2, 0)
    write(c, 4, 2)
    v = write(c, 6, 2, recent_window_tokens=1)
    # se = 0, rs = max(0, 6-1) = 5; pinned and 0 <= 2 < 5 -> [2,4) + [5,8)
    assert c.last_branch == "recent+pin"
    assert toks(v) == [2, 3, 5, 6, 7]


def test_recent_window_sink_pin_branch():
    c = DenseReferenceCache(1, 10, 1, 2, sink_tokens=2, global_sink_tokens=1)
    write(c, 0, 3)
    write(c, 3, 2)
    c.pin_current_chunk(2)  # P = 3 != GS -> E = 1
    assert (c.P, c.PL, c.E) == (3, 2, 1)
    write(c, 5, 3)
    v = write(c, 8, 2, recent_window_tokens=1)
    # ls = 8: se = 1, rs = 7 -> [0,1) + [3,5) + [7,10)
    assert c.last_branch == "recent+sink+pin"
    assert toks(v) == [0, 3, 4, 7, 8, 9]


def test_negative_recent_window_raises_before_change():
    c, _ = _rolled_cache()
    before = snapshot(c)
    with pytest.raises(ValueError):
        write(c, 8, 3, p=1, recent_window_tokens=-1)
    assert_same(before, snapshot(c))


# ---------------------------------------------------------------------------------------------- pins
def test_pin_pp_branch_and_pin_becoming_sink():
    c = DenseReferenceCache(1, 8, 1, 2, sink_tokens=2, attention_window_size=4)
    write(c, 0, 2)
    write(c, 2, 2)
    c.pin_current_chunk(2)
    assert (c.P, c.PL, c.E) == (2, 2, 0)
    v = write(c, 4, 2)  # L = 6, A = 2: pp needs P < A -> no
    assert c.last_branch == "window(sinkless)"
    assert toks(v) == [2, 3, 4, 5]
    v = write(c, 6, 2)  # L = 8, A = 4: pp -> [2,4) + [max(0, 8 - (4 - 2)), 8)
    assert c.last_branch == "pp"
    assert toks(v) == [2, 3, 6, 7]
    v = write(c, 8, 2)  # roll: ev 2, E 0, rolled 6: [2,8)->[0,6); P >= E -> P = 0 == GS -> E = GS + PL = 2
    assert c.slot_global == [2, 3, 4, 5, 6, 7, 8, 9]
    assert (c.P, c.PL, c.E) == (0, 2, 2)
    assert c.last_branch == "ps"
    assert toks(v) == [2, 3, 8, 9]
    v = write(c, 10, 2)  # E 2: ev 2, rolled 4: [4,8)->[2,6); P = 0 < E: unchanged
    assert c.slot_global == [2, 3, 6, 7, 8, 9, 10, 11]
    assert (c.P, c.E) == (0, 2)
    assert toks(v) == [2, 3, 10, 11]


def test_pin_ps_pp_branch():
    c = DenseReferenceCache(1, 8, 1, 2, sink_tokens=2, global_sink_tokens=1, attention_window_size=4)
    write(c, 0, 3)
    write(c, 3, 2)
    c.pin_current_chunk(2)
    assert (c.P, c.PL, c.E) == (3, 2, 1)
    v = write(c, 5, 2)  # L 7, A 3: ps yes, pp: 3 < 3 no
    assert c.last_branch == "ps"
    # [0,1) + [max(1, 7 - (4-1)), 7) = [0,1) + [4,7)
    assert toks(v) == [0, 4, 5, 6]
    v = write(c, 7, 1)  # L 8, A 4: ps+pp: [0,1)+[3,5)+[max(1, 8 - max(0, 4-1-2)), 8) = [0,1)+[3,5)+[7,8)
    assert c.last_branch == "ps+pp"
    assert toks(v) == [0, 3, 4, 7]
    v = write(c, 8, 2)  # roll: E = 1, ev 2, rolled max(0, 8-2-1) = 5: [3,8)->[1,6); P = 3 >= 1 -> P = 1 == GS
    assert c.slot_global == [0, 3, 4, 5, 6, 7, 8, 9]
    assert (c.P, c.PL, c.E) == (1, 2, 3)
    # A = 4, ps: [0,3) + [max(3, 8 - (4-3)), 8) = [0,3) + [7,8)
    assert c.last_branch == "ps"
    assert toks(v) == [0, 3, 4, 9]


def test_pin_clamped_and_unpin():
    c = DenseReferenceCache(1, 8, 1, 2, sink_tokens=2)
    write(c, 0, 5)
    c.pin_current_chunk(5)
    assert (c.P, c.PL) == (0, 2)  # P == GS == 0 -> E = 2
    assert c.E == 2
    c.pin_current_chunk(0)
    assert (c.P, c.PL, c.E) == (-1, 0, 2)
    c2 = DenseReferenceCache(1, 8, 1, 2, sink_tokens=0)
    write(c2, 0, 5)
    c2.pin_current_chunk(3)  # S <= 0 -> unpin
    assert (c2.P, c2.PL) == (-1, 0)


def test_pin_moves_nothing():
    c = DenseReferenceCache(1, 8, 1, 2, sink_tokens=2)
    write(c, 0, 6)
    k = c.k.clone()
    c.pin_current_chunk(2)
    assert torch.equal(k, c.k)
    assert c.slot_global[:6] == list(range(6))


# ---------------------------------------------------------------------------------------------- growth
def test_growth_window_follows_cache_size():
    c = DenseReferenceCache(1, 4, 1, 2, allow_growth=True)
    assert c.W == 4
    write(c, 0, 3)
    v = write(c, 3, 3)  # L + a = 6 > 4 -> C = max(6, 8) = 8, W == old C -> W = 8
    assert (c.C, c.W) == (8, 8)
    assert fields(v) == (3, 6, 6, 6)
    assert toks(v) == list(range(6))
    assert c.k.shape == (1, 8, 1, 2)
    write(c, 6, 2)
    v = write(c, 8, 12)  # L + a = 20 > 8 -> C = max(20, 16) = 20
    assert (c.C, c.W) == (20, 20)
    assert toks(v) == list(range(20))
    assert c.G == c.L == 20


def test_growth_keeps_explicit_window():
    c = DenseReferenceCache(1, 4, 1, 2, allow_growth=True, attention_window_size=2)
    write(c, 0, 4)
    v = write(c, 4, 1)
    assert (c.C, c.W) == (8, 2)
    assert toks(v) == [3, 4]


def test_reset_keeps_grown_size():
    c = DenseReferenceCache(1, 4, 1, 2, allow_growth=True)
    write(c, 0, 6)
    assert c.C == 8
    c.pin_current_chunk(1)
    c.reset_indices()
    assert (c.G, c.L, c.P, c.PL, c.C, c.W) == (0, 0, -1, 0, 8, 8)
    v = write(c, 0, 2, p=3)
    assert toks(v) == [3000, 3001]


# ---------------------------------------------------------------------------------------------- rewrites
def test_inplace_rewrite_and_rewrite_extend():
    c = DenseReferenceCache(1, 8, 1, 2)
    write(c, 0, 4)
    v = write(c, 1, 2, p=1)
    assert fields(v) == (1, 3, 4, 4)
    assert toks(v) == [0, 1001, 1002, 3]
    v = write(c, 2, 4, p=2)  # rewrite [2,4), extend [4,6)
    assert fields(v) == (2, 6, 6, 6)
    assert toks(v) == [0, 1001, 2002, 2003, 2004, 2005]


def test_rewrite_extend_after_roll():
    c, _ = _rolled_cache()  # slots [0,1,5,6,7,8,9,10], G 11, L 8, E 2
    v = write(c, 9, 3, p=1)  # a 1, ev 1, rolled 5: [3,8)->[2,7); ls 5
    assert c.slot_global == [0, 1, 6, 7, 8, 9, 10, 11]
    assert fields(v) == (5, 8, 8, 12)
    assert toks(v) == [0, 1, 6, 7, 8, 1009, 1010, 1011]
    v = write(c, 7, 6, p=2)  # a 1, ev 1 (evicts 6), ls 2: rewrite 7..11 in slots [2,7), 12 new
    assert c.slot_global == [0, 1, 7, 8, 9, 10, 11, 12]
    assert fields(v) == (2, 8, 8, 13)
    assert toks(v) == [0, 1, 2007, 2008, 2009, 2010, 2011, 2012]


def test_rewrite_after_roll_in_rolled_region():
    c, _ = _rolled_cache()
    v = write(c, 5, 2, p=1)  # ls = 5 - 3 = 2
    assert fields(v) == (2, 4, 8, 11)
    assert toks(v) == [0, 1, 1005, 1006, 7, 8, 9, 10]


# ---------------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    "s,n,exc",
    [
        (11, 0, ValueError),  # zero-length
        (-1, 2, ValueError),  # negative start
        (12, 1, SequencingError),  # gap
        (2, 2, SequencingError),  # evicted (ls < 0)
        (3, 1, SequencingError),  # ls = 0: slot 0 holds the sink token 0, not 3
        (4, 2, SequencingError),  # ls = 1: sink slot
        (5, 7, CacheConfigError),  # advance, roll, ls = 1 < E = 2
        (11, 7, CacheConfigError),  # pure append larger than C - E
        (11, 9, CacheConfigError),  # larger than C
        (4, 8, CacheConfigError),  # rewrite-and-extend too large: reported as config error first
    ],
)
def test_errors_change_nothing(s, n, exc):
    c, _ = _rolled_cache()
    before = snapshot(c)
    with pytest.raises(exc):
        if n == 0:
            c.update_and_get_attention_kv(torch.zeros(1, 0, 1, 2), torch.zeros(1, 0, 1, 2), s)
        else:
            write(c, s, n)
    assert_same(before, snapshot(c))
    # the error classes are what pagedqvg documents
    assert issubclass(SequencingError, NotImplementedError)
    assert issubclass(CacheConfigError, ValueError)


def test_chunk_of_exactly_c_minus_e_allowed_after_roll():
    c, _ = _rolled_cache()
    # C - E = 6: chunk of 6 at the start is allowed
    v = write(c, 11, 6)
    assert fields(v) == (2, 8, 8, 17)
    assert c.slot_global == [0, 1, 11, 12, 13, 14, 15, 16]


def test_evicted_rewrite_no_roll_geometry():
    # advance without roll whose retained part is evicted: s < G - L
    c = DenseReferenceCache(1, 6, 1, 2)
    write(c, 0, 6)
    write(c, 6, 4)  # slots [4,5,6,7,8,9], G 10, L 6
    c.rewind_to(8)  # L 4, G 8: slots [4,5,6,7]
    assert c.slot_global[:4] == [4, 5, 6, 7]
    before = snapshot(c)
    with pytest.raises(SequencingError):
        write(c, 3, 6)  # a = 1, no roll: le 5, ls -1
    assert_same(before, snapshot(c))
    v = write(c, 4, 6, p=1)  # a 2, no roll: le 6, ls 0
    assert toks(v) == [1004, 1005, 1006, 1007, 1008, 1009]


def test_head_slice_errors():
    c = DenseReferenceCache(1, 8, 2, 2)
    k, v = chunk(0, 2, 1, 1, 2)
    with pytest.raises(ValueError, match="2"):
        c.update_and_get_attention_kv(k, v, 0)
    with pytest.raises(ValueError):
        c.update_and_get_attention_kv(k, v, 0, cache_head_start=2)
    assert (c.G, c.L) == (0, 0)


# ---------------------------------------------------------------------------------------------- head slices
def test_head_sliced_advance_zero_fills_other_heads():
    c = DenseReferenceCache(1, 4, 2, 2)
    write(c, 0, 4, p=1)  # both heads hold 1000+g
    c.reset_indices()
    v = write(c, 0, 2, Hin=1, cache_head_start=1)
    assert v.k.shape == (1, 2, 1, 2)
    assert toks(v) == [0, 1]
    # head 0 of the new slots is zero, not the stale 1000, 1001
    assert c.k[0, :2, 0].abs().sum() == 0 and c.v[0, :2, 0].abs().sum() == 0
    # head 0 then written by a head-sliced rewrite: head 1 untouched
    k = torch.full((1, 2, 1, 2), 7.0)
    view = c.update_and_get_attention_kv(k, -k, 0, cache_head_start=0)
    assert view.k[0, :, 0, 0].tolist() == [7.0, 7.0]
    assert c.k[0, :2, 1, 0].tolist() == [0.0, 1.0]
    # rewrite-and-extend head-sliced: only the new token's slot is zeroed
    k = torch.full((1, 2, 1, 2), 9.0)
    view = c.update_and_get_attention_kv(k, -k, 1, cache_head_start=1)
    assert c.k[0, :3, 0, 0].tolist() == [7.0, 7.0, 0.0]
    assert c.k[0, :3, 1, 0].tolist() == [0.0, 9.0, 9.0]
    assert view.k.shape == (1, 3, 1, 2)


def test_head_sliced_roll_zero_fills():
    c = DenseReferenceCache(1, 4, 2, 2)
    write(c, 0, 4, p=1)
    write(c, 4, 1, Hin=1, cache_head_start=0)  # roll ev 1: [1,4)->[0,3); slot 3 new
    assert c.slot_global == [1, 2, 3, 4]
    assert c.k[0, :, 1, 0].tolist() == [1001.0, 1002.0, 1003.0, 0.0]
    assert c.k[0, :, 0, 0].tolist() == [1001.0, 1002.0, 1003.0, 4.0]


def test_dtype_cast_on_write():
    c = DenseReferenceCache(1, 4, 1, 2, dtype=torch.bfloat16)
    k = torch.full((1, 1, 1, 2), 1.0 + 2**-10)
    v = c.update_and_get_attention_kv(k, k, 0)
    assert v.k.dtype == torch.bfloat16 and v.k[0, 0, 0, 0].item() == 1.0


# ---------------------------------------------------------------------------------------------- rewind
def test_rewind_before_roll_into_sink():
    c = DenseReferenceCache(1, 8, 1, 2, sink_tokens=4)
    write(c, 0, 5)
    c.rewind_to(5)  # pos == G: no-op
    assert (c.G, c.L) == (5, 5)
    c.rewind_to(1)
    assert (c.G, c.L) == (1, 1)
    assert c.slot_global == [0] + [None] * 7
    v = write(c, 1, 2, p=1)
    assert toks(v) == [0, 1001, 1002]


def test_rewind_after_roll():
    c, _ = _rolled_cache()  # [0,1,5,6,7,8,9,10], G 11, L 8, E 2
    before = snapshot(c)
    for bad in (4, 0, 12, -1):
        with pytest.raises(SequencingError):
            c.rewind_to(bad)
        assert_same(before, snapshot(c))
    c.rewind_to(5)  # first slot 2 >= E
    assert (c.G, c.L) == (5, 2)
    assert c.slot_global == [0, 1] + [None] * 6
    v = write(c, 5, 3, p=1)
    assert fields(v) == (2, 5, 5, 8)
    assert toks(v) == [0, 1, 1005, 1006, 1007]


def test_rewind_pin_clearing():
    c = DenseReferenceCache(1, 8, 1, 2, sink_tokens=2)
    write(c, 0, 2)
    write(c, 2, 2)
    c.pin_current_chunk(2)  # P 2, PL 2
    write(c, 4, 2)
    c.rewind_to(4)  # new L 4: P + PL = 4 <= 4 -> pin kept
    assert (c.P, c.PL) == (2, 2)
    c.rewind_to(3)  # new L 3 < 4 -> cleared
    assert (c.P, c.PL) == (-1, 0)
    assert c.E == 2


def test_rewind_into_sink_after_roll_refused_even_if_slots_match():
    # the pinned chunk becomes the sink after a roll; the slots of [pos, G) then hold exactly [pos, G) but start
    # below E while a roll has happened -> refused
    c = DenseReferenceCache(1, 4, 1, 2, sink_tokens=2)
    write(c, 0, 2)
    write(c, 2, 2)
    c.pin_current_chunk(2)  # P 2, PL 2, E 0
    write(c, 4, 2)  # ev 2, rolled 2: [2,4)->[0,2); P -> 0 == GS -> E 2
    assert c.slot_global == [2, 3, 4, 5]
    assert (c.P, c.E, c.G, c.L) == (0, 2, 6, 4)
    assert c.slot_global[1:4] == [3, 4, 5]
    before = snapshot(c)
    with pytest.raises(SequencingError):
        c.rewind_to(3)
    assert_same(before, snapshot(c))
    c.rewind_to(4)  # first slot 2 >= E
    assert (c.G, c.L, c.P, c.PL) == (4, 2, 0, 2)


def test_rewind_slots_mismatch_after_roll():
    c = DenseReferenceCache(1, 4, 1, 2, sink_tokens=2)
    write(c, 0, 4)
    write(c, 4, 2)  # ev 2, rolled 0: slots [0,1,4,5], G 6, L 4
    assert c.slot_global == [0, 1, 4, 5]
    with pytest.raises(SequencingError):
        c.rewind_to(3)
    c.rewind_to(4)
    assert (c.G, c.L) == (4, 2)


def test_can_direct_current_attention():
    c = DenseReferenceCache(1, 8, 1, 2)
    assert c.can_direct_current_attention(8)
    assert not c.can_direct_current_attention(4)
    assert not DenseReferenceCache(1, 8, 1, 2, sink_tokens=1).can_direct_current_attention(8)
    assert not DenseReferenceCache(1, 8, 1, 2, attention_window_size=4).can_direct_current_attention(8)
    assert DenseReferenceCache(1, 4, 1, 2, attention_window_size=4).can_direct_current_attention(4)


def test_batch_two_independent_rows():
    c = DenseReferenceCache(2, 4, 1, 2)
    k = torch.stack([torch.full((3, 1, 2), 1.0), torch.full((3, 1, 2), 2.0)])
    v = c.update_and_get_attention_kv(k, -k, 0)
    assert v.k.shape == (2, 3, 1, 2)
    assert torch.equal(v.k, k)
