"""The two designs pagedqvg replaces, written from their described behaviour (shared/SEMANTICS.md, DESIGN.md).

- `DenseCache`: one `[B, C, H, D]` K and V buffer per layer, rolled in place; views are slices (zero-copy when the
  view is one range) or a `torch.cat` of ranges.
- `SegmentListCache`: SGLang's QVG packed cache as described: a Python list of per-chunk segments, each its own
  torch allocation (bf16 tensors or a dict of PRQ tensors); at each advance segments left of the rolling tail are
  dropped by list filtering and completed segments are packed; every view allocates a fresh dense output and, per
  visible segment, copies a bf16 slice or dequantizes the whole packed segment into a temporary and copies the slice.
  Accepts only "rewrite the current chunk" and "append at the end".

Both support the LingBot/LongLive2 call pattern without pins (the segment list refuses pins, as the reference does).
"""

from __future__ import annotations

import torch

from pagedqvg.cache.sequencing import effective_sink, view_slot_ranges
from pagedqvg.quant import QuantConfig, prq_dequantize, prq_quantize


class DenseCache:
    """The dense per-layer cache of SEMANTICS.md (no growth, no pins, full heads)."""

    def __init__(self, *, batch_size, cache_size, num_heads, head_dim, dtype, device, sink_tokens=0,
                 global_sink_tokens=0, attention_window_size=None):
        self.k = torch.zeros(batch_size, cache_size, num_heads, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.C, self.S, self.GS = cache_size, sink_tokens, global_sink_tokens
        self.W = attention_window_size or cache_size
        self.G = self.L = 0

    def resident_nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def update_and_get_attention_kv(self, *, key, value, current_chunk_start, recent_window_tokens=None):
        n = key.shape[1]
        s, e = current_chunk_start, current_chunk_start + key.shape[1]
        E = effective_sink(self.S, self.GS, -1, 0)
        if e <= self.G:
            ls = s - (self.G - self.L)
            le = ls + n
        else:
            a = e - self.G
            if self.L + a > self.C:
                ev = self.L + a - self.C
                rolled = max(0, self.L - ev - E)
                src = slice(E + ev, E + ev + rolled)
                self.k[:, E : E + rolled] = self.k[:, src].clone()
                self.v[:, E : E + rolled] = self.v[:, src].clone()
                le = self.C
            else:
                le = self.L + a
            ls = le - n
            self.L, self.G = le, e
        self.k[:, ls:le] = key
        self.v[:, ls:le] = value
        ranges = view_slot_ranges(local_end=self.L, window=self.W, sink=E, global_sink_tokens=self.GS, pin_start=-1,
                                  pin_len=0, local_start=ls, recent_window_tokens=recent_window_tokens)
        if len(ranges) == 1:
            a, b = ranges[0]
            return self.k[:, a:b], self.v[:, a:b]
        return torch.cat([self.k[:, a:b] for a, b in ranges], 1), torch.cat([self.v[:, a:b] for a, b in ranges], 1)


class SegmentListCache:
    """SGLang's QVG packed cache as DESIGN.md describes it (per-segment allocations, per-segment temporaries)."""

    def __init__(self, *, batch_size, cache_size, num_heads, head_dim, dtype, device, sink_tokens=0,
                 global_sink_tokens=0, attention_window_size=None, quant: QuantConfig | None = None):
        self.C, self.S, self.GS = cache_size, sink_tokens, global_sink_tokens
        self.W = attention_window_size or cache_size
        self.quant = quant if quant is not None and quant.enabled else None
        self.dtype, self.device = dtype, device
        self.segments: list[dict] = []  # {"g0", "g1", "k", "v"} or packed {"g0", "g1", "pk", "pv"}
        self.G = 0

    def resident_nbytes(self) -> int:
        total = 0
        for seg in self.segments:
            if "k" in seg:
                total += seg["k"].numel() * seg["k"].element_size() * 2
            else:
                for p in (seg["pk"], seg["pv"]):
                    total += p.token_rows.numel() + p.codebooks.numel() * p.codebooks.element_size()
        return total

    def _pack(self, seg: dict) -> None:
        B, n, H, D = seg["k"].shape
        for name in ("k", "v"):
            x = seg.pop(name).permute(1, 0, 2, 3).reshape(n, B * H, D)
            seg["p" + name] = prq_quantize(x, self.quant)
        seg["shape"] = (B, n, H, D)

    def _dequant(self, seg: dict, name: str) -> torch.Tensor:
        B, n, H, D = seg["shape"]
        p = seg["p" + name]
        return prq_dequantize(p.token_rows, p.codebooks, p.fmt).reshape(n, B, H, D).permute(1, 0, 2, 3)

    def update_and_get_attention_kv(self, *, key, value, current_chunk_start, recent_window_tokens=None):
        s, e = current_chunk_start, current_chunk_start + key.shape[1]
        sink_end = max(self.GS, self.S)
        if s == self.G:  # append a new segment
            self.G = e
            tail = max(sink_end, self.G - (self.C - sink_end))
            self.segments = [g for g in self.segments if g["g0"] < sink_end or g["g1"] > tail]
            self.segments.append({"g0": s, "g1": e, "k": key.clone(), "v": value.clone()})
            if self.quant is not None:
                cfg = self.quant
                nonsink = [g for g in self.segments[:-1] if g["g0"] >= sink_end]
                for g in nonsink[: max(0, len(nonsink) - cfg.keep_recent_chunks)]:
                    if "k" in g:
                        self._pack(g)
                if cfg.sink:
                    sinks = [g for g in self.segments[:-1] if g["g0"] < sink_end]
                    for g in sinks[cfg.sink_keep_chunks :]:
                        if "k" in g:
                            self._pack(g)
        elif self.segments and s == self.segments[-1]["g0"] and e == self.segments[-1]["g1"]:
            self.segments[-1]["k"].copy_(key)
            self.segments[-1]["v"].copy_(value)
        else:
            raise NotImplementedError("non-sequential write")
        tail = max(sink_end, self.G - (self.W - sink_end))
        visible = [(g, max(g["g0"], 0 if g["g0"] < sink_end else tail), g["g1"]) for g in self.segments]
        visible = [(g, a, min(b, sink_end) if g["g0"] < sink_end and b <= tail else b) for g, a, b in visible]
        visible = [(g, a, b) for g, a, b in visible if a < b]
        if len(visible) == 1 and "k" in visible[0][0]:
            g, a, b = visible[0]
            return g["k"][:, a - g["g0"] : b - g["g0"]], g["v"][:, a - g["g0"] : b - g["g0"]]
        total = sum(b - a for _, a, b in visible)
        B, _, H, D = key.shape
        out_k = torch.empty(B, total, H, D, dtype=self.dtype, device=self.device)
        out_v = torch.empty_like(out_k)
        o = 0
        for g, a, b in visible:
            for name, out in (("k", out_k), ("v", out_v)):
                src = g[name] if name in g else self._dequant(g, name)  # whole-segment temporary
                out[:, o : o + b - a] = src[:, a - g["g0"] : b - g["g0"]]
            o += b - a
        return out_k, out_v
