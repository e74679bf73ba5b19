"""Dense, plain-torch reference of the cache contract (docs/SEMANTICS.md).

This module is the independent test oracle for ``pagedqvg.PagedCausalKVCache``.  It is written only from the
contract: it owns real slot buffers ``k``, ``v`` of shape ``[B, C, H, D]`` and moves data between slots exactly like the
dense SGLang cache does.  It also keeps ``slot_global`` (which global token each slot holds, ``None`` for a slot that
holds nothing) so that it can decide on its own, from first principles, whether a write or a rewind is one of the
cases where pagedqvg deliberately refuses (see "Where pagedqvg deliberately differs").

Order of checks in ``update_and_get_attention_kv`` (every check happens before anything changes):

1. argument errors -> ``ValueError``: ``n == 0``, ``start < 0``, ``recent_window_tokens < 0``, key/value shape
   mismatch, a head slice without ``cache_head_start`` (or out of range);
2. a gap (``start > G``) -> ``SequencingError``;
3. geometry (growth, roll, ``ls``/``le``); an advance that rolls with ``ls < E`` -> ``CacheConfigError``;
4. the retained part of the write (positions ``[s, min(e, G))``) must sit in slots that hold exactly those global
   positions (after the roll, for an advance) -> ``SequencingError`` otherwise.

Deliberate differences from the dense cache reproduced here:

* head-sliced advances: the slots of the ``a`` newly appended tokens are zero-filled on all heads before the write;
* ``rewind_to`` exists (the dense cache has none).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedqvg import CacheConfigError, SequencingError

__all__ = [
    "CacheConfigError",
    "DenseReferenceCache",
    "RefView",
    "SequencingError",
]


@dataclass
class RefView:
    k: torch.Tensor
    v: torch.Tensor
    local_start_index: int
    local_end_index: int
    visible_local_end: int
    visible_global_end: int


class DenseReferenceCache:
    def __init__(
        self,
        batch_size: int,
        cache_size: int,
        num_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        sink_tokens: int = 0,
        attention_window_size: int | None = None,
        global_sink_tokens: int = 0,
        allow_growth: bool = False,
    ) -> None:
        self.B = int(batch_size)
        self.C = int(cache_size)
        self.H = int(num_heads)
        self.D = int(head_dim)
        self.dtype = dtype
        self.S = int(sink_tokens)
        # W: 0/None means C.
        self.W = int(attention_window_size) if attention_window_size else self.C
        self.GS = int(global_sink_tokens)
        self.grow = bool(allow_growth)
        self.k = torch.zeros(self.B, self.C, self.H, self.D, dtype=dtype)
        self.v = torch.zeros(self.B, self.C, self.H, self.D, dtype=dtype)
        self.slot_global: list[int | None] = [None] * self.C
        self.G = 0
        self.L = 0
        self.P = -1
        self.PL = 0
        # Instrumentation for tests: which view branch the last call used, and whether it rolled/grew.
        self.last_branch: str | None = None
        self.last_rolled = False
        self.last_grew = False
        self.last_view_past_local_end = False

    # ------------------------------------------------------------------ state helpers
    @property
    def pinned(self) -> bool:
        return self.P >= 0 and self.PL > 0

    @property
    def E(self) -> int:
        if self.pinned:
            return self.GS + self.PL if self.P == self.GS else self.GS
        return max(self.GS, self.S)

    @property
    def num_cache_heads(self) -> int:
        return self.H

    def retained_globals(self) -> list[int]:
        """Global positions held by slots [0, L), in slot order."""
        out = []
        for j in range(self.L):
            g = self.slot_global[j]
            assert g is not None, f"slot {j} < L={self.L} holds nothing"
            out.append(g)
        return out

    # ------------------------------------------------------------------ other calls
    def pin_current_chunk(self, n: int) -> None:
        if self.S <= 0 or n <= 0:
            self.P, self.PL = -1, 0
        else:
            self.P, self.PL = self.L - n, min(self.S, n)

    def reset_indices(self) -> None:
        self.G = 0
        self.L = 0
        self.P, self.PL = -1, 0
        self.slot_global = [None] * self.C

    def can_direct_current_attention(self, n: int) -> bool:
        return self.S == 0 and n == self.C and n == self.W

    def rewind_to(self, pos: int) -> None:
        pos = int(pos)
        G, L = self.G, self.L
        if pos == G:
            return
        if pos < 0 or pos > G:
            raise SequencingError(f"rewind_to({pos}): position outside [0, {G}]")
        d = G - pos
        first = L - d
        if first < 0:
            raise SequencingError(f"rewind_to({pos}): tokens before {G - L} were evicted")
        if self.slot_global[first:L] != list(range(pos, G)):
            raise SequencingError(f"rewind_to({pos}): tokens [{pos}, {G}) are not in slots [{first}, {L})")
        if not (first >= self.E or G == L):
            raise SequencingError(f"rewind_to({pos}): would cut into the sink (slot {first} < E={self.E}) after a roll")
        for j in range(first, L):
            self.slot_global[j] = None
        self.L = first
        self.G = pos
        if self.pinned and self.P + self.PL > self.L:
            self.P, self.PL = -1, 0

    # ------------------------------------------------------------------ the main call
    def update_and_get_attention_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        current_chunk_start: int,
        cache_head_start: int | None = None,
        recent_window_tokens: int | None = None,
    ) -> RefView:
        # ---- 1. argument checks
        if key.dim() != 4 or tuple(key.shape) != tuple(value.shape):
            raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} must be equal [B, n, H, D]")
        B, n, Hin, D = key.shape
        if B != self.B or D != self.D:
            raise ValueError(f"key shape {tuple(key.shape)} does not match B={self.B}, D={self.D}")
        s = int(current_chunk_start)
        r = recent_window_tokens
        if n == 0:
            raise ValueError("zero-length chunk")
        if s < 0:
            raise ValueError(f"negative current_chunk_start {s}")
        if r is not None and r < 0:
            raise ValueError(f"negative recent_window_tokens {r}")
        if Hin != self.H:
            if cache_head_start is None:
                raise ValueError(f"key has {Hin} heads but the cache has {self.H}; cache_head_start is required")
            h0 = int(cache_head_start)
        else:
            h0 = 0 if cache_head_start is None else int(cache_head_start)
        if h0 < 0 or h0 + Hin > self.H:
            raise ValueError(f"heads [{h0}, {h0 + Hin}) outside [0, {self.H})")
        e = s + n
        G, L, C, W, E = self.G, self.L, self.C, self.W, self.E

        # ---- 2. gap
        if s > G:
            raise SequencingError(f"write starts at {s} > global end {G}")

        # ---- 3. geometry (computed, nothing changed yet)
        slot_after = list(self.slot_global)
        new_C, new_W = C, W
        grew = rolled_flag = False
        roll = None
        if e <= G:
            a = 0
            ls = s - (G - L)
            le = ls + n
        else:
            a = e - G
            if self.grow and L + a > new_C:
                new_C = max(L + a, 2 * C)
                if W == C:
                    new_W = new_C
                grew = True
                slot_after = slot_after + [None] * (new_C - C)
            if L + a > new_C:
                ev = L + a - new_C
                rolled = max(0, L - ev - E)
                le = new_C
                ls = le - n
                if ls < E:
                    raise CacheConfigError(
                        f"chunk of n={n} tokens (start {s}, end {e}) would overwrite sink slots: C={new_C}, E={E}; "
                        f"a chunk that rolls must be at most C - E = {new_C - E} tokens"
                    )
                roll = (ev, rolled)
                rolled_flag = True
                slot_after[E : E + rolled] = slot_after[E + ev : E + ev + rolled]
            else:
                le = L + a
                ls = le - n

        # ---- 4. retained part must sit exactly where the dense cache will write it
        kept = min(e, G) - s  # number of retained positions written
        if kept > 0 and (ls < 0 or slot_after[ls : ls + kept] != list(range(s, s + kept))):
            raise SequencingError(
                f"write [{s}, {e}) rewrites positions [{s}, {s + kept}) that are not retained in place "
                f"(global_end={G}, local_end={L}, C={new_C})"
            )
        # range check of the contract (cannot fail after the checks above)
        assert ls >= 0 and le <= new_C and le - ls == n, (ls, le, new_C, n, s, e, G, L)

        # ---- commit: growth, roll, write
        if grew:
            k = torch.zeros(self.B, new_C, self.H, self.D, dtype=self.dtype)
            v = torch.zeros(self.B, new_C, self.H, self.D, dtype=self.dtype)
            k[:, :C] = self.k
            v[:, :C] = self.v
            self.k, self.v = k, v
            self.C, self.W = new_C, new_W
        if roll is not None:
            ev, rolled = roll
            if rolled > 0:
                self.k[:, E : E + rolled] = self.k[:, E + ev : E + ev + rolled].clone()
                self.v[:, E : E + rolled] = self.v[:, E + ev : E + ev + rolled].clone()
            if self.pinned and self.P >= E:
                self.P -= ev
        self.slot_global = slot_after
        if a > 0:
            # deliberate difference: new tokens' slots start as zeros on every head
            self.k[:, le - a : le] = 0
            self.v[:, le - a : le] = 0
            for j in range(le - a, le):
                self.slot_global[j] = G + (j - (le - a))
            self.L = le
            self.G = e
        self.k[:, ls:le, h0 : h0 + Hin] = key
        self.v[:, ls:le, h0 : h0 + Hin] = value
        self.last_rolled = rolled_flag
        self.last_grew = grew

        # ---- 5. view
        ranges = self._view_ranges(ls, r)
        # instrumentation: the dense view can read slots at or past L (never written since the last reset) only in
        # the "ps" branch when E > L; tests use this to point at that case.
        self.last_view_past_local_end = any(b_ > self.L and b_ > a_ for a_, b_ in ranges)
        heads = slice(h0, h0 + Hin)
        kv = [self.k[:, a_:b_, heads] for a_, b_ in ranges]
        vv = [self.v[:, a_:b_, heads] for a_, b_ in ranges]
        return RefView(
            k=torch.cat(kv, dim=1).clone(),
            v=torch.cat(vv, dim=1).clone(),
            local_start_index=ls,
            local_end_index=le,
            visible_local_end=self.L,
            visible_global_end=self.G,
        )

    def _view_ranges(self, ls: int, r: int | None) -> list[tuple[int, int]]:
        L, W, E, P, PL = self.L, self.W, self.E, self.P, self.PL
        pinned = self.pinned
        A = max(0, L - W)
        if r is None:
            if self.GS > 0 or pinned:
                ps = E > 0 and A > 0
                pp = pinned and E <= P < A
                if ps and pp:
                    self.last_branch = "ps+pp"
                    return [(0, E), (P, P + PL), (max(E, L - max(0, W - E - PL)), L)]
                if ps:
                    self.last_branch = "ps"
                    return [(0, E), (max(E, L - max(0, W - E)), L)]
                if pp:
                    self.last_branch = "pp"
                    return [(P, P + PL), (max(0, L - max(0, W - PL)), L)]
                self.last_branch = "window(sinkless)"
                return [(A, L)]
            self.last_branch = "window"
            return [(A, L)]
        se = min(E, L)
        rs = max(se, ls - r)
        if rs <= se:
            self.last_branch = "recent:all"
            return [(0, L)]
        out = []
        br = "recent"
        if se > 0:
            out.append((0, se))
            br += "+sink"
        if pinned and se <= P < rs:
            out.append((P, P + PL))
            br += "+pin"
        out.append((rs, L))
        self.last_branch = br
        return out
