"""Bitmask fill cost on mixed dev schemas.

``gramcoord bench fill`` (or ``run_bench('fill', [], out)``) measures, side
by side in one run, on the real Qwen2.5 vocabulary:

- ``builder_overhead_b{N}``: ``BitmaskBuilder.build`` (K = 0, parallel
  fill off) against a bare ``xgr.BatchGrammarMatcher(1)`` filling the same
  matchers into the same buffer with one ``batch_fill_next_token_bitmask``
  call: the cheapest sequential fill xgrammar offers, and the call the
  builder itself makes. Target: overhead <= 10%, i.e. ratio >= 0.91.
- ``parallel_fill_b{N}``: the builder's parallel fill (xgrammar's
  ``BatchGrammarMatcher``) against its sequential fill. Target >= 1.6x at
  batch >= 128 on 2 cores.
- ``thread_pool_fill_b{N}``: the alternative the builder did not keep, a
  chunked thread pool (the caller plus ``threads - 1`` workers pulling
  chunks of 16), against the same sequential fill. Reported only.

The batches mix dev schemas (small and medium ones that compile quickly with
the real vocabulary and have a valid instance xgrammar accepts), each
matcher advanced along its instance to a seeded random point. Jump-forward
is measured by ``gramcoord bench jump_forward``.

With the defaults it takes about 30 s on an idle 2-core machine.
"""

from __future__ import annotations

import argparse
import random
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import xgrammar as xgr

from gramcoord.benchmarks._contract import BenchRecord, add_data_arg, round_robin_ms
from gramcoord.benchmarks.jump_forward import dev_records, usable_instances
from gramcoord.rank_worker.grammars.tokenizer import load_tokenizer
from gramcoord.rank_worker.masks.bitmask import BitmaskBuilder, default_fill_threads
from gramcoord.rank_worker.masks.grammar_state import GrammarState

CHUNK = 16


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="gramcoord bench fill")
    add_data_arg(p, max_label_ms=60.0)
    p.add_argument("--batches", type=int, nargs="+", default=[64, 256])
    p.add_argument("--repeat", type=int, default=61, help="timed repeats per figure")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-schemas", type=int, default=120, help="schemas compiled at most")
    p.add_argument("--threads", type=int, default=0, help="fill threads (0: builder default)")
    args = p.parse_args(argv)
    return args


def _batch(tokenizer, usable, n: int, rng: random.Random) -> list[GrammarState]:
    states = []
    for i in range(n):
        _, compiled, text = usable[i % len(usable)]
        tokens = tokenizer.encode(text)
        state = GrammarState(compiled)
        state.accept_tokens(tokens[: rng.randrange(len(tokens))])
        states.append(state)
    return states


class PoolFill:
    """The alternative the builder did not keep: chunks of ``CHUNK`` matchers on a
    thread pool, pulled by ``threads - 1`` workers and the caller."""

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self.pool = ThreadPoolExecutor(max(1, threads - 1), thread_name_prefix="fill-pool")

    def batch_fill_next_token_bitmask(self, matchers, out, indices=None) -> None:
        rows = list(range(len(matchers))) if indices is None else list(indices)
        bounds = [(lo, min(lo + CHUNK, len(matchers))) for lo in range(0, len(matchers), CHUNK)]
        lock = threading.Lock()
        it = iter(bounds)

        def work() -> None:
            while True:
                with lock:
                    span = next(it, None)
                if span is None:
                    return
                for j in range(*span):
                    matchers[j].fill_next_token_bitmask(out, rows[j])

        futures = [self.pool.submit(work) for _ in range(self.threads - 1)]
        work()
        for f in futures:
            f.result()


def _fill_records(args, tokenizer, usable) -> list[BenchRecord]:
    threads = args.threads or default_fill_threads()
    records = []
    pool = PoolFill(threads)
    for n in args.batches:
        rng = random.Random(args.seed + n)
        states = _batch(tokenizer, usable, n, rng)
        matchers = [s.matcher for s in states]
        kw = dict(max_num_seqs=n, num_threads=threads)
        seq = BitmaskBuilder(tokenizer.vocab_size, parallel_threshold=n + 1, **kw)
        par = BitmaskBuilder(tokenizer.vocab_size, parallel_threshold=1, **kw)
        bare = np.full((n, seq.width), -1, dtype=np.int32)
        one_thread = xgr.BatchGrammarMatcher(1)

        def bare_fill(engine=one_thread, out=bare, ms=matchers):
            engine.batch_fill_next_token_bitmask(ms, out)

        assert not seq.build(states).failures
        np.testing.assert_array_equal(seq.build(states).bitmask, par.build(states).bitmask)
        bare_fill()
        np.testing.assert_array_equal(bare, seq.build(states).bitmask)
        t_bare, t_seq, t_par, t_pool = round_robin_ms(
            [
                bare_fill,
                lambda b=seq, s=states: b.build(s),
                lambda b=par, s=states: b.build(s),
                lambda ms=matchers, out=bare: pool.batch_fill_next_token_bitmask(ms, out),
            ],
            repeat=args.repeat,
            warmup=3,
            pause_gc=True,
        )
        note = f"batch {n}, {len(usable)} schemas, {threads} threads"
        records += [
            BenchRecord.compare(
                f"builder_overhead_b{n}",
                "bare_batch_matcher_1",
                t_seq,
                t_bare,
                target=0.91,
                note=note + "; ratio >= 0.91 means overhead <= 10%",
            ),
            BenchRecord.compare(
                f"parallel_fill_b{n}",
                "sequential_fill",
                t_par,
                t_seq,
                target=1.6 if n >= 128 else None,
                note=note + "; BatchGrammarMatcher (kept)",
            ),
            BenchRecord.compare(
                f"thread_pool_fill_b{n}",
                "sequential_fill",
                t_pool,
                t_seq,
                note=note + f"; chunked pool, chunks of {CHUNK} (not kept)",
            ),
        ]
    pool.pool.shutdown()
    return records


def run(args: list[str]) -> list[BenchRecord]:
    a = _args(args)
    tokenizer = load_tokenizer()
    t0 = time.perf_counter()
    usable = usable_instances(tokenizer, dev_records(a), True, a.max_schemas)
    print(
        f"compiled {len(usable)} usable dev schemas in {time.perf_counter() - t0:.1f} s",
        file=sys.stderr,
    )
    return _fill_records(a, tokenizer, usable)
