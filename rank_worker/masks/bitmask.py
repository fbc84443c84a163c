"""The bitmask builder: next-token masks for a batch, speculative rows included.

Layout::

    rows_per_request = 1 + K            K = speculative tokens per request
    bitmask: int32[n * rows_per_request, ceil(V / 32)]

    request 0 | row 0: mask before draft 0
              | row 1: mask after draft 0
              | ...
              | row K: bonus row, after drafts 0..K-1
    request 1 | ...

Rows follow the scheduling order. ``-1`` (all bits set) allows every token:
it is what a row gets when there is nothing to constrain (a gated phase,
rows after padding, a rejected draft or a stop token, a failed request).

Row ``i`` of a request is the mask *after* accepting drafts ``0..i-1``. The
builder advances each grammar along its drafts and rolls it back by exactly
the number of tokens it advanced, so a build never changes real state:
``validate_tokens`` answers the same before and after. The row at the first
padding or rejected draft is the bonus row and carries the mask of the
state reached so far; every later row is ``-1``.

A constrained row that allows no token at all is a dead state. On the
request's real state (its first row) that fails the request with
``grammar_dead_state``; its rows become ``-1`` so the batch samples as usual
and the caller drops the request. A dead row reached only through drafts
frees that row and the later ones, like a rejected draft: the verifier may
still reject the drafts that lead there.

The buffer is allocated once, at ``max_num_seqs * rows_per_request`` rows;
``build`` returns a view of its first rows.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import xgrammar as xgr

from gramcoord.rank_worker.errors import ErrorCode, GrammarError
from gramcoord.rank_worker.masks.gate import Phase
from gramcoord.rank_worker.masks.grammar_state import GrammarState, live_rows, strip_padding

# Parallel fill (K == 0 only). Measured with ``benchmarks/fill.py`` on the
# 2-core dev VM (shared with other jobs: figures swing by +-30% between runs),
# mixed dev schemas at random progress, real Qwen2.5 vocabulary, medians of
# 61 interleaved rounds. Speedup over the sequential fill at batch 256, in six
# runs:
#
#   BatchGrammarMatcher(2)          1.67 1.73 1.41 1.70 1.27 1.16  median 1.54
#   thread pool (caller + 1 worker,
#   chunks of 16 matchers)          1.00 1.77 0.96 1.70 1.13 1.27  median 1.20
#
# On a quiet machine (load < 1, three runs) the order flips slightly:
#
#   BatchGrammarMatcher(2)          1.49 1.59 1.44                 median 1.49
#   thread pool                     1.64 1.87 1.45                 median 1.64
#
# At batch 64 neither is reliably faster than one thread (0.94-1.65x both),
# hence the threshold. BatchGrammarMatcher is kept because it degrades far
# less when the other core is busy, which is the normal case in an engine
# (scheduler, model runner and transport share the CPU with the fill): its C++ workers split the
# batch without the GIL, while the pool's threads re-take the GIL around
# every fill call and pay for futures and wake-ups, which hurts most when the
# other core is busy. Below the threshold the same call runs on one thread;
# it is ~5% cheaper than a Python loop of fill calls, which pays for the
# builder's own work (gating, dead-row scan): ratio 0.96-1.03 against the
# bare loop.
DEFAULT_PARALLEL_THRESHOLD = 128


def default_fill_threads() -> int:
    """Fill threads: half the cores (at most 8), but at least 2.

    ``min(cpu // 2, 8)`` alone gives one thread on a 2-core machine,
    which cannot run in parallel at all.
    """
    return max(2, min((os.cpu_count() or 2) // 2, 8))


class BuildResult(NamedTuple):
    """What one ``build`` produced.

    ``bitmask``: view ``[n * rows_per_request, W]`` of the builder's buffer,
    valid until the next build. ``failures``: batch index -> the error that
    fails that request (its rows are all ``-1``).
    """

    bitmask: np.ndarray
    failures: dict[int, GrammarError]


def trim_drafts(state: GrammarState, drafts: Sequence[int]) -> list[int]:
    """Keep the longest grammar-valid prefix of ``drafts`` (padding removed).

    The first invalid position becomes the bonus row of the next build, and
    its mask is the state after the kept prefix. The state is unchanged.
    """
    return state.validate_tokens(strip_padding(drafts))


class BitmaskBuilder:
    """Fill the bitmask rows of a batch of constrained requests.

    Parameters
    ----------
    vocab_size:
        Model vocabulary (lm_head rows, padded); rows hold
        ``ceil(vocab_size / 32)`` words. It must equal the compiled grammars'
        vocabulary size.
    max_num_seqs:
        Most constrained requests in one batch.
    num_speculative_tokens:
        K, the draft tokens per request; each request owns ``K + 1`` rows.
    parallel_threshold:
        With ``K == 0``, batches of at least this many requests are filled
        by xgrammar's ``BatchGrammarMatcher`` on ``num_threads`` threads.
    num_threads:
        Fill threads; default ``default_fill_threads()``.
    """

    def __init__(
        self,
        vocab_size: int,
        *,
        max_num_seqs: int,
        num_speculative_tokens: int = 0,
        parallel_threshold: int = DEFAULT_PARALLEL_THRESHOLD,
        num_threads: int | None = None,
    ) -> None:
        if vocab_size <= 0 or max_num_seqs <= 0 or num_speculative_tokens < 0:
            raise ValueError(
                f"need vocab_size > 0, max_num_seqs > 0, num_speculative_tokens >= 0; got "
                f"{vocab_size}, {max_num_seqs}, {num_speculative_tokens}"
            )
        self.vocab_size = vocab_size
        self.width = (vocab_size + 31) // 32
        self.max_num_seqs = max_num_seqs
        self.num_speculative_tokens = num_speculative_tokens
        self.rows_per_request = num_speculative_tokens + 1
        self.parallel_threshold = parallel_threshold
        self.num_threads = num_threads or default_fill_threads()
        self._buffer = np.full(
            (max_num_seqs * self.rows_per_request, self.width), -1, dtype=np.int32
        )
        self._engines: dict[int, xgr.BatchGrammarMatcher] = {}

    def build(
        self,
        states: Sequence[GrammarState],
        drafts: Sequence[Sequence[int]] | None = None,
        *,
        out: np.ndarray | None = None,
    ) -> BuildResult:
        """Fill the rows of ``states``, in order, with their drafts.

        Parameters
        ----------
        states:
            One grammar state per constrained request, in scheduling order.
        drafts:
            Per request, up to K draft tokens (``-1`` pads). ``None``: none.
        out:
            Where to fill instead of the builder's own buffer: an int32
            ``[rows, width]`` array with at least ``len(states) * (K + 1)``
            rows, e.g. a transport ring slot, so that publishing the rows
            copies nothing.

        Returns
        -------
        BuildResult
            The bitmask view and the per-request failures
            (``grammar_dead_state``, ``grammar_terminated``).

        Raises
        ------
        ValueError
            More requests than ``max_num_seqs``, more than K drafts, or a
            grammar whose vocabulary differs from ``vocab_size``.
        """
        n = len(states)
        if n > self.max_num_seqs:
            raise ValueError(f"batch of {n} requests exceeds max_num_seqs={self.max_num_seqs}")
        if drafts is not None and len(drafts) != n:
            raise ValueError(f"{len(drafts)} draft lists for {n} requests")
        target = self._buffer if out is None else out
        if target.dtype != np.int32 or target.ndim != 2 or target.shape[1] != self.width:
            raise ValueError(
                f"out must be int32 [rows, {self.width}], got {target.dtype} {target.shape}"
            )
        if target.shape[0] < n * self.rows_per_request:
            raise ValueError(f"out has {target.shape[0]} rows; {n * self.rows_per_request} needed")
        out = target[: n * self.rows_per_request]
        failures: dict[int, GrammarError] = {}
        if self.num_speculative_tokens == 0:
            if drafts is not None and any(d and d[0] >= 0 for d in drafts):
                raise ValueError("drafts given to a builder with K=0 speculative tokens")
            self._fill_next(states, out, failures)
        else:
            for i, state in enumerate(states):
                self._fill_request(state, () if drafts is None else drafts[i], i, out, failures)
        return BuildResult(out, failures)

    # -- K == 0 ---------------------------------------------------------

    def _fill_next(
        self, states: Sequence[GrammarState], out: np.ndarray, failures: dict[int, GrammarError]
    ) -> None:
        vocab = self.vocab_size
        matchers: list[xgr.GrammarMatcher] = []
        rows: list[int] = []
        # The hot loop reads GrammarState's fields directly: a property call
        # per request is a measurable share of a cheap fill.
        for i, state in enumerate(states):
            if state.vocab_size != vocab:
                self._check_vocab(state)
            if state._phase is Phase.CONSTRAINED:
                matchers.append(state._matcher)
                rows.append(i)
            else:
                state.fill_row(out, i)
        if matchers:
            engine = self._engine(parallel=len(states) >= self.parallel_threshold)
            try:
                # All constrained: rows are 0..n-1, so skip the index list.
                indices = None if len(rows) == len(states) else rows
                engine.batch_fill_next_token_bitmask(matchers, out, indices)
            except RuntimeError:
                # xgrammar refuses the whole batch if one matcher has accepted
                # a stop token; find those and fill the others one by one.
                for matcher, i in zip(matchers, rows):
                    if matcher.is_terminated():
                        failures[i] = _terminated_error()
                        out[i] = -1
                    else:
                        matcher.fill_next_token_bitmask(out, i)
        # One vectorised scan finds dead rows; gated and failed rows are live.
        for i in np.flatnonzero(~live_rows(out, vocab)).tolist():
            failures[i] = _dead_error(i)
            out[i] = -1

    def _engine(self, *, parallel: bool) -> xgr.BatchGrammarMatcher:
        threads = self.num_threads if parallel else 1
        engine = self._engines.get(threads)
        if engine is None:
            engine = self._engines[threads] = xgr.BatchGrammarMatcher(threads)
        return engine

    # -- K > 0 ----------------------------------------------------------

    def _fill_request(
        self,
        state: GrammarState,
        drafts: Sequence[int],
        index: int,
        out: np.ndarray,
        failures: dict[int, GrammarError],
    ) -> None:
        self._check_vocab(state)
        tokens = strip_padding(drafts)
        if len(tokens) > self.num_speculative_tokens:
            raise ValueError(
                f"request {index} has {len(tokens)} drafts; the builder holds "
                f"K={self.num_speculative_tokens}"
            )
        base = index * self.rows_per_request
        end = base + self.rows_per_request
        if state.is_terminated:
            failures[index] = _terminated_error()
            out[base:end] = -1
            return
        advanced = 0
        try:
            for j in range(self.rows_per_request):
                row = base + j
                constrained = state.is_constrained
                state.fill_row(out, row)
                if constrained and not live_rows(out[row : row + 1], self.vocab_size)[0]:
                    if j == 0:
                        failures[index] = _dead_error(index)
                        out[base:end] = -1
                    else:
                        out[row:end] = -1
                    return
                # Padding, a rejected draft or a stop token frees later rows.
                if j == len(tokens) or not state.advance(tokens[j]):
                    out[row + 1 : end] = -1
                    return
                advanced += 1
                if state.is_terminated:
                    out[row + 1 : end] = -1
                    return
        finally:
            state.rollback(advanced)

    def _check_vocab(self, state: GrammarState) -> None:
        if state.vocab_size != self.vocab_size:
            raise ValueError(
                f"grammar vocabulary has {state.vocab_size} tokens; the bitmask is built for "
                f"{self.vocab_size}"
            )


def _terminated_error() -> GrammarError:
    return GrammarError(
        ErrorCode.grammar_terminated,
        "the request was scheduled after its grammar accepted a stop token",
    )


def _dead_error(index: int) -> GrammarError:
    return GrammarError(
        ErrorCode.grammar_dead_state,
        f"request {index}: the grammar allows no token in its current state",
    )
