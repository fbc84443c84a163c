"""``MaskDigests`` (the vLLM plugin's TP mask digests) over a real gloo group of two ranks."""

from __future__ import annotations

import numpy as np
import pytest

from gramcoord.integrations.vllm.tp_digest import flip_one_bit, row_digests
from tests.integrations.digest_ranks import digests_body
from tests.procs import run_ranks


def test_flip_one_bit_clears_one_allowed_token_of_the_first_row_allowing_two():
    bitmask = np.zeros((3, 2), dtype=np.int32)
    bitmask[0, 1] = 0b100  # one token: left alone
    bitmask[1, 1] = 0b110
    bitmask[2, 0] = -1
    assert flip_one_bit(bitmask) == 1
    assert bitmask[1, 1] == 0b100 and bitmask[0, 1] == 0b100 and bitmask[2, 0] == -1
    assert flip_one_bit(np.zeros((2, 2), dtype=np.int32)) is None


@pytest.mark.parametrize("words", [4748, 7])  # the Qwen2.5 vocabulary's width; an odd one
def test_a_row_digest_changes_with_any_one_bit_and_nothing_else(words):
    rng = np.random.default_rng(1)
    bitmask = rng.integers(-(1 << 31), 1 << 31, size=(3, words), dtype=np.int32)
    before = row_digests(bitmask)
    assert before.dtype == np.uint64 and before.shape == (3,)
    assert (row_digests(bitmask.copy()) == before).all()  # the same on every call and rank
    for word, bit in ((0, 0), (words - 1, 31), (words // 2, 17)):
        changed = bitmask.copy()
        changed[1, word] ^= np.int32(np.uint32(1 << bit).view(np.int32))
        after = row_digests(changed)
        assert after[1] != before[1] and after[0] == before[0] and after[2] == before[2]


@pytest.mark.spawn
@pytest.mark.timeout(120)
def test_identical_masks_post_windows_and_find_nothing():
    r0, r1 = (r.value for r in run_ranks(digests_body, 2, args=(None, 10), timeout=90))
    assert r0 == r1
    assert r0["mismatches"] == [] and r0["failed"] == []
    assert r0["steps"] == 10  # steps without structured rows are not digested


@pytest.mark.spawn
@pytest.mark.timeout(120)
def test_a_bit_flipped_on_one_rank_fails_that_request_on_every_rank_by_name():
    r0, r1 = (r.value for r in run_ranks(digests_body, 2, args=((1, 5), 16), timeout=90))
    assert r0 == r1
    # Step 5 is in the window of steps 4-7, posted at step 7 and settled at
    # step 11 with the next window: request "b", output position 5, rank 1.
    assert r0["mismatches"] == [(5, (1,), "b", 5)]
    assert r0["failed"] == ["b"] and r0["codes"] == ["tp_mask_mismatch"]
    assert r0["failed_at"] == 11
