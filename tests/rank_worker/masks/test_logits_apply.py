"""TP-side apply: row alignment, indices, stale rows, dtypes, and the CUDA path."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gramcoord.rank_worker.masks.logits_apply import (
    CudaMaskStaging,
    LogitsMasker,
    apply_bitmask_cuda,
    plan_rows,
)

V = 100
W = (V + 31) // 32


def reference(logits: torch.Tensor, aligned: np.ndarray, rows) -> torch.Tensor:
    """Mask by unpacking bits, row by row: the slow, obvious way."""
    out = logits.clone().float()
    for r in rows:
        bits = np.unpackbits(aligned[r].view(np.uint8), bitorder="little")[:V].astype(bool)
        out[r, torch.from_numpy(~bits)] = float("-inf")
    return out.to(logits.dtype)


def random_bitmask(n_rows: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(-(2**31), 2**31, size=(n_rows, W), dtype=np.int64).astype(np.int32)


@pytest.mark.parametrize(
    ("batch", "constrained", "drafts", "k", "dst", "indices_none"),
    [
        pytest.param("abc", "abc", {}, 0, [0, 1, 2], True, id="all-constrained"),
        pytest.param("abc", "cab", {}, 0, [2, 0, 1], True, id="all-constrained-reordered"),
        pytest.param("abcd", "da", {}, 0, [3, 0], False, id="subset"),
        pytest.param("abc", "ca", {"a": 2, "c": 1}, 2, [4, 5, 0, 1, 2], False, id="drafts"),
        pytest.param("abc", "b", {"a": 2, "c": 1}, 2, [3], False, id="drafts-unconstrained"),
        pytest.param("ab", "ab", {"a": 1, "b": 1}, 1, [0, 1, 2, 3], True, id="drafts-all"),
        pytest.param("abc", "", {}, 0, [], False, id="none"),
    ],
)
def test_plan_rows(batch, constrained, drafts, k, dst, indices_none):
    plan = plan_rows(list(batch), list(constrained), drafts, k + 1)
    assert plan.dst.tolist() == dst
    assert (plan.indices is None) == indices_none
    assert plan.num_logit_rows == len(batch) + sum(drafts.values())
    # Bitmask rows: request j's block starts at j * (k + 1).
    expected_src = [
        j * (k + 1) + i for j, rid in enumerate(constrained) for i in range(1 + drafts.get(rid, 0))
    ]
    assert plan.src.tolist() == expected_src


@pytest.mark.parametrize(
    ("batch", "constrained", "drafts", "match"),
    [
        pytest.param("ab", "c", {}, "not in the batch", id="unknown"),
        pytest.param("ab", "aa", {}, "twice", id="duplicate-constrained"),
        pytest.param("aa", "a", {}, "twice", id="duplicate-batch"),
        pytest.param("ab", "a", {"a": 2}, "drafts", id="too-many-drafts"),
    ],
)
def test_plan_rows_rejects(batch, constrained, drafts, match):
    with pytest.raises(ValueError, match=match):
        plan_rows(list(batch), list(constrained), drafts, 2)


@pytest.mark.parametrize(
    ("batch", "constrained", "drafts", "k"),
    [
        pytest.param("abc", "abc", {}, 0, id="all"),
        pytest.param("abcd", "da", {}, 0, id="subset"),
        pytest.param("abc", "ca", {"a": 2, "c": 1}, 2, id="drafts"),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_cpu_apply_masks_exactly_the_planned_rows(batch, constrained, drafts, k, dtype):
    plan = plan_rows(list(batch), list(constrained), drafts, k + 1)
    bitmask = random_bitmask(len(constrained) * (k + 1), seed=len(plan.dst))
    logits = torch.randn(plan.num_logit_rows, V, generator=torch.Generator().manual_seed(0))
    logits = logits.to(dtype)
    masker = LogitsMasker(W, max_rows=8)
    aligned = np.full((plan.num_logit_rows, W), -1, dtype=np.int32)
    aligned[plan.dst] = bitmask[plan.src]
    expected = reference(logits, aligned, plan.dst.tolist())
    masker.apply(logits, bitmask, plan)
    assert logits.dtype == dtype
    torch.testing.assert_close(logits, expected, rtol=0, atol=0)


def test_second_call_leaves_no_stale_rows():
    masker = LogitsMasker(W, max_rows=8)
    block = np.zeros((3, W), dtype=np.int32)  # every token masked
    first = torch.zeros(3, V)
    masker.apply(first, block, plan_rows(list("abc"), list("abc"), {}, 1))
    assert torch.isinf(first).all()
    second = torch.zeros(3, V)
    masker.apply(second, block[:1], plan_rows(list("abc"), ["b"], {}, 1))
    assert (masker.aligned[[0, 2]] == -1).all(), "rows of a and c are stale"
    assert torch.isinf(second[1]).all()
    assert (second[[0, 2]] == 0).all()


@pytest.mark.parametrize(
    ("logits", "bitmask", "match"),
    [
        pytest.param(torch.zeros(1, W * 32 + 1), np.zeros((1, W), np.int32), "padded", id="wide"),
        pytest.param(torch.zeros(2, V), np.zeros((1, W), np.int32), "rows", id="row-count"),
        pytest.param(torch.zeros(1, V), np.zeros((1, W + 1), np.int32), "int32", id="width"),
        pytest.param(torch.zeros(1, V), np.zeros((1, W), np.int64), "int32", id="dtype"),
    ],
)
def test_bad_shapes_are_rejected(logits, bitmask, match):
    with pytest.raises(ValueError, match=match):
        LogitsMasker(W, max_rows=2).apply(logits, bitmask, plan_rows("a", "a", {}, 1))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_cuda_apply_matches_cpu(dtype):
    staging = CudaMaskStaging(W, max_rows=8)
    cpu = LogitsMasker(W, max_rows=8)
    steps = [
        (list("abc"), list("ca"), {"a": 2, "c": 1}, 2),
        (list("abc"), list("abc"), {}, 0),
        (list("abcd"), ["b"], {}, 0),
    ]
    for step, (batch, constrained, drafts, k) in enumerate(steps):
        plan = plan_rows(batch, constrained, drafts, k + 1)
        bitmask = random_bitmask(len(constrained) * (k + 1), seed=step)
        logits = torch.randn(plan.num_logit_rows, V).to(dtype)
        on_gpu = logits.cuda()
        cpu.apply(logits, bitmask, plan)
        apply_bitmask_cuda(on_gpu, bitmask, plan, staging)
        torch.testing.assert_close(on_gpu.cpu(), logits, rtol=0, atol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_apply_never_syncs_the_host():
    staging = CudaMaskStaging(W, max_rows=8)
    plan = plan_rows(list("abcd"), ["d", "a"], {"a": 1}, 2)
    bitmask = random_bitmask(4, seed=3)
    logits = torch.randn(plan.num_logit_rows, V, device="cuda")
    apply_bitmask_cuda(logits, bitmask, plan, staging)  # compiles the kernel
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(2):  # both pinned slots
            apply_bitmask_cuda(logits, bitmask, plan, staging)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def test_logits_on_another_device_are_rejected():
    logits = torch.zeros(1, V, device="meta")
    with pytest.raises(ValueError, match="CPU or CUDA"):
        LogitsMasker(W, max_rows=2).apply(
            logits, np.zeros((1, W), np.int32), plan_rows("a", "a", {}, 1)
        )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_logits_masker_takes_cuda_logits(dtype):
    """One LogitsMasker masks CUDA logits as it masks CPU ones, step after step
    (stale rows included), through its own staging."""
    on_cpu, on_cuda = LogitsMasker(W, max_rows=8), LogitsMasker(W, max_rows=8)
    steps = [
        (list("abc"), list("ca"), {"a": 2, "c": 1}, 2),
        (list("abc"), list("abc"), {}, 0),
        (list("abcd"), ["b"], {}, 0),
        (list("ab"), [], {}, 0),
    ]
    for step, (batch, constrained, drafts, k) in enumerate(steps):
        plan = plan_rows(batch, constrained, drafts, k + 1)
        bitmask = random_bitmask(len(constrained) * (k + 1), seed=step)
        logits = torch.randn(plan.num_logit_rows, V).to(dtype)
        gpu = logits.cuda()
        on_cpu.apply(logits, bitmask, plan)
        on_cuda.apply(gpu, bitmask, plan)
        assert gpu.device.type == "cuda" and gpu.dtype == dtype
        torch.testing.assert_close(gpu.cpu(), logits, rtol=0, atol=0)
    assert len(on_cuda._staging) == 1
