"""The k-means kernels (kernels/kmeans.py references, kernels/triton_kmeans.py kernels): assignment and update.

Runs like tests/test_kernels_page_write.py: without CUDA the Triton kernels run in Triton's interpreter on CPU
tensors (TRITON_INTERPRET=1 is set by helpers.py before anything imports triton; if triton was already imported in
compiled mode, `test_interpreter_in_subprocess` reruns this file in a fresh process). On a CUDA machine the same
comparisons run on CUDA tensors with compiled kernels.

- Assignment: ids compared exactly where the arithmetic is exact (small integers times powers of two: any summation
  order gives the same distances, so ties to the lowest index are tested exactly) and where every token's margin
  between its two nearest centroids exceeds the fp32 error bound (asserted on the data); elsewhere (random data,
  constructed near-ties) the ids may differ, and every difference is checked to lie within the fp32 error bound of
  the two distances (kmeans.distance_error_bound). Which tokens differ depends on the summation orders, i.e. on the
  BLAS and instruction set of the machine, so no test asserts that none do.
- Update: identical where sums are exact (dyadic data), else within `helpers.update_error_bound`; deterministic;
  empty clusters keep their centroid; typed argument errors and the opt-in id range check.
The kernels' compile-shape checks are in tests/test_kernels_dequant.py (assign) and
tests/test_kernels_residual_pack.py (update), each in one AOT report with the kernel it runs next to.
"""

from __future__ import annotations

import zlib

import pytest
import torch
from helpers import (  # sets TRITON_INTERPRET
    check_near_ties,
    distance_margins,
    exact_means,
    rerun_interpreted,
    triton_kernels,
    update_error_bound,
)

from pagedqvg.kernels import dispatch
from pagedqvg.kernels.pack.kmeans import kmeans_assign_torch, kmeans_update_torch

tkm, TRITON_ERROR, DEVICE, WHY = triton_kernels("pack.triton_kmeans", "_kmeans_assign_kernel")
needs_kernels = pytest.mark.skipif(DEVICE is None, reason=WHY)


# ---------------------------------------------------------------------------------------------- k-means assign
# (name, H, S, K, D)
KMEANS_SHAPES = [("H2-S300-K128-D64", 2, 300, 128, 64), ("H3-S70-K37-D24", 3, 70, 37, 24), ("K1", 1, 9, 1, 16),
                 ("K-gt-S", 2, 5, 77, 32)]  # fmt: skip


@needs_kernels
@pytest.mark.parametrize("shape", KMEANS_SHAPES, ids=lambda s: s[0])
def test_kmeans_assign_exact_arithmetic_identical(shape):
    """Small integers / 16: every distance is exact in fp32 whatever the order, so ids (ties included) are equal."""
    _, H, S, K, D = shape
    gen = torch.Generator().manual_seed(zlib.crc32(shape[0].encode()))
    x = torch.randint(-8, 8, (H, S, D), generator=gen).float() / 16
    c = torch.randint(-8, 8, (H, K, D), generator=gen).float() / 16
    if K > 3:
        c[:, 3] = c[:, 1]  # exact duplicate: must resolve to 1
        x[:, : min(S, 4)] = c[:, 1:2]  # tokens sitting on it
    ref = kmeans_assign_torch(x, c)
    got = tkm.kmeans_assign_triton(x.to(DEVICE), c.to(DEVICE)).cpu()
    assert torch.equal(got, ref)
    if K > 3:
        assert not (got == 3).any()


@needs_kernels
@pytest.mark.parametrize("shape", KMEANS_SHAPES[:2], ids=lambda s: s[0])
def test_kmeans_assign_random_data(shape):
    """PRQ-like input (normalised to |x| < 1, centroids K distinct tokens, a strided x): the contract, i.e. ids
    equal except at rounding-level near-ties, each verified (which tokens are near-ties depends on the summation
    orders, i.e. on the machine's BLAS); every token whose two nearest centroids are further apart than the fp32
    error bound has the same id on both paths, and on this data that is nearly every token (an exact fp64 property
    of the data, the same on every machine)."""
    _, H, S, K, D = shape
    gen = torch.Generator().manual_seed(zlib.crc32(("r" + shape[0]).encode()))
    x = torch.randn(S, H, D, generator=gen).transpose(0, 1)  # [H, S, D], non-contiguous like a transposed segment
    x = x / (2 * x.abs().amax())
    c = x[:, torch.randperm(S, generator=gen)[:K]].contiguous()
    ref = kmeans_assign_torch(x.contiguous(), c)
    got = tkm.kmeans_assign_triton(x.to(DEVICE), c.to(DEVICE)).cpu()
    check_near_ties(x, c, got, ref)
    gap, bound = distance_margins(x, c)
    clear = gap > bound
    assert torch.equal(got[clear], ref[clear])
    assert int(clear.sum()) >= 0.95 * H * S, int(clear.sum())  # measured: all but a handful of the H * S tokens


@needs_kernels
@pytest.mark.parametrize("shape", KMEANS_SHAPES, ids=lambda s: s[0])
def test_kmeans_assign_separated_data_identical(shape):
    """Tokens near well-separated centroids: every token's margin (second-nearest minus nearest exact distance)
    exceeds the sum of the two fp32 error bounds (asserted), so any summation order picks the same centroid and the
    ids are equal on every machine."""
    name, H, S, K, D = shape
    gen = torch.Generator().manual_seed(zlib.crc32(("s" + name).encode()))
    c = torch.randn(H, K, D, generator=gen)
    c = c / c.norm(dim=-1, keepdim=True)  # unit vectors: random pairs are ~sqrt(2) apart in D >= 16
    own = torch.randint(K, (H, S), generator=gen)
    x = c[torch.arange(H)[:, None], own] + torch.randn(H, S, D, generator=gen) * (0.02 / D**0.5)
    gap, bound = distance_margins(x, c)
    assert bool((gap > bound).all()), "test data: a token is within rounding of two centroids"
    ref = kmeans_assign_torch(x, c)
    assert torch.equal(ref, own)  # the intended centroid (which also checks the data)
    got = tkm.kmeans_assign_triton(x.transpose(0, 1).contiguous().transpose(0, 1).to(DEVICE), c.to(DEVICE)).cpu()
    assert torch.equal(got, ref)


@needs_kernels
def test_kmeans_assign_near_ties_within_rounding():
    """Tokens on the bisector of two centroids (plus 1e-7 noise): ids may differ, only within the error bound, and
    only where the data leave the two nearest centroids within rounding of each other."""
    gen = torch.Generator().manual_seed(17)
    H, S, K, D = 2, 600, 48, 64
    c = torch.randn(H, K, D, generator=gen) * 0.1
    a = torch.randint(K, (H, S), generator=gen)
    b = torch.randint(K, (H, S), generator=gen)
    heads = torch.arange(H)[:, None]
    x = (c[heads, a] + c[heads, b]) / 2 + torch.randn(H, S, D, generator=gen) * 1e-7
    ref = kmeans_assign_torch(x, c)
    got = tkm.kmeans_assign_triton(x.to(DEVICE), c.to(DEVICE)).cpu()
    n_diff = check_near_ties(x, c, got, ref)
    gap, bound = distance_margins(x, c)
    ambiguous = gap <= bound
    assert int(ambiguous.sum()) > S * H // 20  # the data are adversarial (exact fp64 property, any machine)
    assert n_diff <= int(ambiguous.sum())
    assert torch.equal(got[~ambiguous], ref[~ambiguous])


def test_kmeans_dispatch_torch_backend(monkeypatch):
    monkeypatch.setenv("PAGEDQVG_KERNELS", "torch")
    x = torch.randn(2, 5, 8)
    c = x[:, :3].clone()
    assert torch.equal(dispatch.kmeans_assign(x, c)[:, :3], torch.arange(3).expand(2, 3))


# ---------------------------------------------------------------------------------------------- k-means update
# (name, H, S, K, D)
UPDATE_SHAPES = [("H2-S300-K128-D64", 2, 300, 128, 64), ("H3-S70-K37-D24", 3, 70, 37, 24), ("S1", 2, 1, 5, 16),
                 ("K-gt-S", 2, 5, 77, 32), ("H4-S600-K128-D128", 4, 600, 128, 128)]  # fmt: skip


@needs_kernels
@pytest.mark.parametrize("shape", UPDATE_SHAPES, ids=lambda s: s[0])
def test_kmeans_update_matches_reference(shape):
    name, H, S, K, D = shape
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    ids = torch.randint(K, (H, S), generator=gen)
    c_old = torch.randn(H, K, D, generator=gen)
    # Dyadic data: every sum is exact in any order, the division is IEEE in both: identical bits.
    xi = torch.randint(-64, 64, (H, S, D), generator=gen).float() / 32
    got = tkm.kmeans_update_triton(xi.to(DEVICE), ids.to(DEVICE), c_old.to(DEVICE)).cpu()
    assert torch.equal(got, kmeans_update_torch(xi, ids, c_old))
    # Random data: both within the summation-order bound of the exact means; empty clusters keep c_old exactly.
    x = torch.randn(S, H, D, generator=gen).transpose(0, 1)  # strided like prq's transposed segment
    got = tkm.kmeans_update_triton(x.to(DEVICE), ids.to(DEVICE), c_old.to(DEVICE)).cpu()
    again = tkm.kmeans_update_triton(x.to(DEVICE), ids.to(DEVICE), c_old.to(DEVICE)).cpu()
    ref = kmeans_update_torch(x.contiguous(), ids, c_old)
    exact, bound = exact_means(x, ids, c_old), update_error_bound(x, ids, c_old)
    assert torch.equal(got, again)  # deterministic: no atomics
    assert bool(((got.double() - exact).abs() <= bound).all())
    assert bool(((ref.double() - exact).abs() <= bound).all())
    empty = torch.ones(H, K, dtype=torch.bool).scatter_(1, ids, False)
    assert torch.equal(got[empty], c_old[empty])


def test_kmeans_update_dispatch_and_bad_arguments(monkeypatch):
    monkeypatch.setenv("PAGEDQVG_KERNELS", "torch")
    x = torch.tensor([[[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]])
    c = torch.zeros(1, 3, 2)
    got = dispatch.kmeans_update(x, torch.tensor([[0, 0, 2]]), c)
    assert torch.equal(got, torch.tensor([[[2.0, 3.0], [0.0, 0.0], [5.0, 6.0]]]))
    with pytest.raises(ValueError, match=r"ids must be int64 \[H, S\] = \(1, 3\)"):
        dispatch.kmeans_update(x, torch.tensor([[0, 0]]), c)
    with pytest.raises(TypeError, match="must be float32"):
        dispatch.kmeans_update(x.double(), torch.tensor([[0, 0, 1]]), c)


@needs_kernels
def test_kmeans_update_ids_out_of_range_checked(monkeypatch, debug_on):
    monkeypatch.setenv("PAGEDQVG_KERNELS", "triton")
    x = torch.randn(1, 3, 16, device=DEVICE)
    with pytest.raises(IndexError, match=r"centroid id out of range: 0\.\.3, valid 0\.\.2"):
        dispatch.kmeans_update(x, torch.tensor([[0, 3, 1]], device=DEVICE), torch.zeros(1, 3, 16, device=DEVICE))


@pytest.mark.skipif(DEVICE is not None or TRITON_ERROR is not None,
                    reason="the kernels already run in this process" if DEVICE is not None else WHY)
def test_interpreter_in_subprocess():
    """Fallback when this process imported triton in compiled mode and has no GPU: rerun this file interpreted."""
    rerun_interpreted(__file__)
