"""The Ulysses head-slice path across processes: 2 ranks (torch.distributed, gloo, CPU), each with its own pool and
a cache holding every head (as SGLang allocates it), each writing and viewing its `cache_head_start = rank x local
heads` slice. The ranks' views, all-gathered along heads, equal one process's views of a cache written with all
heads, bit for bit (and the dense reference's). Also runnable as a script:
`python tests/test_integrations_sglang_ulysses.py RANK WORLD INIT_FILE OUT` is one rank."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

B, H, D, C = 1, 4, 8, 24
CHUNK, CHUNKS, STEPS = 4, 8, 3


def scenario():
    """(kind, args) calls: per chunk one advance and STEPS - 1 rewrites (the last with a recent window), a scene
    cut (pin) after chunk 3. Data: deterministic full-head K/V per call."""
    gen = torch.Generator().manual_seed(11)
    calls = []
    for chunk in range(CHUNKS):
        for step in range(STEPS):
            k = torch.randn(B, CHUNK, H, D, generator=gen)
            v = torch.randn(B, CHUNK, H, D, generator=gen)
            calls.append(("update", (k, v, chunk * CHUNK, 2 if step == STEPS - 1 else None)))
        if chunk == 3:
            calls.append(("pin", (CHUNK,)))
    return calls


def make_cache(pool):
    from pagedqvg.integrations.sglang.integration import PagedCausalSelfAttentionKVCache

    buf = torch.zeros(B, C, H, D)
    return PagedCausalSelfAttentionKVCache(
        buf, buf, torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long), 0, 0,
        sink_tokens=CHUNK, global_sink_tokens=0, pool=pool,
    )  # fmt: skip


def run_rank(rank: int, world: int, init_file: str, out: str) -> None:
    import torch.distributed as dist

    from pagedqvg import BlockPool

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        local = H // world
        h0 = rank * local
        cache = make_cache(BlockPool(capacity_bytes=256 * 1024, page_bytes=1024))
        gathered = []
        for kind, args in scenario():
            if kind == "pin":
                cache.pin_current_chunk(*args)
                continue
            k, v, start, r = args
            view = cache.update_and_get_attention_kv(
                key=k[:, :, h0 : h0 + local].contiguous(),
                value=v[:, :, h0 : h0 + local].contiguous(),
                current_chunk_start=start,
                cache_head_start=h0,
                recent_window_tokens=r,
            )
            assert view.k.shape[2] == local
            parts = []
            for t in (view.k, view.v):
                pieces = [torch.empty_like(t) for _ in range(world)]
                dist.all_gather(pieces, t.contiguous())
                parts.append(torch.cat(pieces, dim=2))
            gathered.append((*parts, view.local_start_index, view.local_end_index, view.visible_global_end))
        if rank == 0:
            torch.save(gathered, out)
    finally:
        dist.destroy_process_group()


def test_ulysses_ranks_equal_one_process_with_all_heads(tmp_path):
    from dense_reference import DenseReferenceCache

    from pagedqvg import BlockPool

    init_file, out = str(tmp_path / "store"), str(tmp_path / "views.pt")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.dirname(__file__)), *sys.path])}
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, str(rank), "2", init_file, out],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for rank in range(2)
    ]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=180)[0].decode(errors="replace"))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)
    gathered = torch.load(out)

    single = make_cache(BlockPool(capacity_bytes=256 * 1024, page_bytes=1024))
    ref = DenseReferenceCache(B, C, H, D, sink_tokens=CHUNK)
    i = 0
    for kind, args in scenario():
        if kind == "pin":
            single.pin_current_chunk(*args)
            ref.pin_current_chunk(*args)
            continue
        k, v, start, r = args
        view = single.update_and_get_attention_kv(key=k, value=v, current_chunk_start=start, recent_window_tokens=r)
        want = ref.update_and_get_attention_kv(k, v, start, None, r)
        gk, gv, ls, le, g_end = gathered[i]
        i += 1
        assert torch.equal(gk, view.k) and torch.equal(gv, view.v)
        assert torch.equal(view.k, want.k) and torch.equal(view.v, want.v)
        assert (ls, le, g_end) == (view.local_start_index, view.local_end_index, view.visible_global_end)
    assert i == len(gathered) == CHUNKS * STEPS
    assert single.pinned_start >= 0  # the scene cut pinned, and the pinned view branch ran on both sides


if __name__ == "__main__":
    run_rank(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
