"""Pick one token per masked logits row, identically on every rank and run.

- ``temperature == 0``: greedy, the argmax (the lowest id among ties).
- ``temperature > 0``: inverse-CDF sampling from ``softmax(logits / T)``.
  Each row's uniform draw is a 53-bit integer hashed from
  ``(sampling.seed, request_id, output position)`` and nothing else: no RNG
  state is consumed, so the pick does not depend on the batch's order or
  composition, on how many tokens other requests sampled, or on the
  process.

The CDF is exact integer arithmetic, so no summation order (batch size,
threads, device kernel) can move a pick: each token's weight
``exp((logit - max) / T)`` is computed in float32 (elementwise) and
quantized to an integer, ``floor(weight * 2**40)``; the weights are summed
in int64 per block of 1,024 tokens, the block is chosen from the blocks'
cumulative sums and the token inside it from the block's own. The token
with the best logit weighs ``2**40``; a token more than ``40 ln 2 ~ 27.7``
temperature-scaled logits below it weighs 0, i.e. probabilities below
``1e-12`` of the best token's are dropped.

The logits must already be masked (disallowed tokens at ``-inf``): a masked
token has probability 0 and is never picked. A row with no finite logit is
an error.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from gramcoord.rank_worker.config import SamplingConfig

_SCALE = 2.0**40
_BLOCK = 1024
_UNIFORM_BITS = 53


def uniform_bits(seed: int, request_id: str, position: int) -> int:
    """A uniform 53-bit integer that depends only on its arguments."""
    data = b"\0".join((str(seed).encode(), request_id.encode("utf-8"), str(position).encode()))
    word = int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")
    return word >> (64 - _UNIFORM_BITS)


class Sampler:
    """Greedy or seeded sampling of masked logits rows.

    Parameters
    ----------
    config:
        ``temperature`` (0 = greedy) and ``seed``.
    """

    def __init__(self, config: SamplingConfig) -> None:
        self.config = config

    @property
    def greedy(self) -> bool:
        return self.config.temperature == 0

    def sample(self, logits: torch.Tensor, keys: Sequence[tuple[str, int]]) -> list[int]:
        """One token id per row of ``logits`` (``[n, V]``, already masked).

        ``keys[i] = (request_id, output position)`` of row ``i``: the position
        the picked token will take in the request's output.

        Raises
        ------
        ValueError
            ``keys`` does not match the rows, or a row's best logit is not
            finite (every token masked, or NaN/inf logits).
        """
        if logits.dim() != 2 or logits.shape[0] != len(keys):
            raise ValueError(f"{len(keys)} keys for logits of shape {tuple(logits.shape)}")
        if not len(keys):
            return []
        best, picks = logits.max(dim=-1)
        bad = ~torch.isfinite(best)
        if bool(bad.any()):
            rows = bad.nonzero().flatten().tolist()
            raise ValueError(f"logits rows {rows} have no finite best logit (all masked?)")
        if self.greedy:
            return picks.tolist()
        return self._inverse_cdf(logits, best, keys)

    def _inverse_cdf(
        self, logits: torch.Tensor, best: torch.Tensor, keys: Sequence[tuple[str, int]]
    ) -> list[int]:
        n, vocab = logits.shape
        device = logits.device
        scaled = logits.float().sub(best.float().unsqueeze(-1)).div_(self.config.temperature)
        weights = scaled.exp_().mul_(_SCALE).to(torch.int64)  # masked: exactly 0
        full = vocab // _BLOCK
        sums = [weights[:, : full * _BLOCK].view(n, full, _BLOCK).sum(-1)]
        if vocab % _BLOCK:
            sums.append(weights[:, full * _BLOCK :].sum(-1, keepdim=True))
        block_cdf = torch.cat(sums, dim=1).cumsum_(dim=-1)
        # target = floor(u * total) with u = bits / 2**53: in [0, total).
        seed = self.config.seed
        totals = block_cdf[:, -1].tolist()
        targets = torch.tensor(
            [
                (uniform_bits(seed, rid, pos) * total) >> _UNIFORM_BITS
                for (rid, pos), total in zip(keys, totals)
            ],
            dtype=torch.int64,
            device=device,
        ).unsqueeze(-1)
        # The first block, then token, whose cumulative weight exceeds the
        # target: its own weight is > 0, so a masked token is never chosen.
        block = torch.searchsorted(block_cdf, targets, right=True)
        before = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp_(min=0)), 0)
        start = block * _BLOCK
        index = start + torch.arange(_BLOCK, device=device)
        inside = weights.gather(1, index.clamp(max=vocab - 1))
        inside.masked_fill_(index >= vocab, 0)
        offset = torch.searchsorted(inside.cumsum_(dim=-1), targets - before, right=True)
        return (start + offset).squeeze(-1).tolist()
