"""Admission costs against a cold compile, and in-flight de-duplication.

Rows (real Qwen2.5 vocabulary, one process):

- ``cache_hit_admission`` vs ``cold_compile``: ``add`` + one local step for
  a key already in the compile cache, against the same for a new key
  (target: < 0.5 ms absolute);
- ``poisoned_repeat`` vs ``cold_compile``: ``add`` of a key poisoned as
  INVALID, which fails at once with no compile (target: < 1 ms);
- ``dedup_N_identical`` vs ``no_dedup_N_identical``: wall time until N
  concurrent requests for one new key are all ready, through the manager
  (one compile, N-1 joins) against N independent compiles on the same pool.

- ``thread_compile`` vs ``subprocess_compile``: a compile in a worker thread
  against the cost a killable subprocess compile would add on top, shipping
  the ``CompiledGrammar`` back (``serialize_json`` + ``deserialize_json``);
  median over a sample of dev schemas. This is why stuck compiles are
  handled with spare threads rather than killable processes.

Usage: ``gramcoord bench compile [--out DIR] [-- --repeat R --n N]``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import xgrammar as xgr

from gramcoord.launch.bench import BenchRecord, add_data_arg, median_ms
from gramcoord.launch.workload import dev_data_dir
from gramcoord.rank_worker.config import GrammarConfig
from gramcoord.rank_worker.grammars.compile_service import XGrammarBackend
from gramcoord.rank_worker.grammars.manager import GrammarManager
from gramcoord.rank_worker.grammars.spec import validate_spec
from gramcoord.rank_worker.grammars.tokenizer import load_tokenizer

_counter = itertools.count()


def _schema(tag: str) -> dict:
    # Realistic, mid-sized: nested object, enum, array, formats.
    return {
        "json": {
            "type": "object",
            "properties": {
                f"id_{tag}": {"type": "integer", "minimum": 0},
                "name": {"type": "string", "maxLength": 64},
                "email": {"type": "string", "format": "email"},
                "role": {"enum": ["admin", "user", "guest"]},
                "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
                "address": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city"],
                },
            },
            "required": [f"id_{tag}", "name", "role"],
        }
    }


def _admit(manager: GrammarManager, spec: dict) -> None:
    rid = f"r{next(_counter)}"
    out = manager.add(rid, spec)
    while out.status != "failed":
        done = manager.step()
        if done:
            assert done[0].status == "admitted", done[0]
            manager.finish(rid)
            return
        time.sleep(0.0002)


def _serialization_overhead(tok, limit: int, data: Path) -> tuple[float, float, int]:
    """Median compile ms and median compile+ship ms over dev schemas."""
    lines = (data / "schemas-dev.jsonl").read_text().splitlines()
    labels = [json.loads(x) for x in (data / "schemas-dev.xgrammar-labels.jsonl").open()]
    # Every 15th of the full set; denser over the smaller tests/data subset.
    step = min(15, max(1, len(lines) // limit))
    compiler = xgr.GrammarCompiler(tok.info, max_threads=1, cache_enabled=False)
    plain, shipped = [], []
    for line, label in list(zip(lines, labels))[::step][:limit]:
        # Labelled over 1 s with a small vocabulary: slower still with this
        # one, and dropped below anyway, so not compiled at all.
        if label.get("compile_ms", 0.0) > 1000.0:
            continue
        schema = json.loads(line)["schema"]
        try:
            t0 = time.perf_counter()
            compiled = compiler.compile_json_schema(json.dumps(schema))
            t1 = time.perf_counter()
        except Exception:
            continue
        if (t1 - t0) > 1.0:  # keep the sample quick
            continue
        blob = compiled.serialize_json()
        xgr.CompiledGrammar.deserialize_json(blob, tok.info)
        t2 = time.perf_counter()
        plain.append((t1 - t0) * 1e3)
        shipped.append((t2 - t0) * 1e3)
    return statistics.median(plain), statistics.median(shipped), len(plain)


def run(args: list[str]) -> list[BenchRecord]:
    p = argparse.ArgumentParser(prog="bench compile")
    p.add_argument("--repeat", type=int, default=15)
    p.add_argument("--n", type=int, default=8, help="concurrent identical requests")
    p.add_argument("--schemas", type=int, default=30, help="dev schemas for the ship row")
    add_data_arg(p)
    opts = p.parse_args(args)
    tok = load_tokenizer()
    cfg = GrammarConfig(num_compile_workers=2)
    manager = GrammarManager(cfg, tok)
    try:
        cold = median_ms(lambda: _admit(manager, _schema(str(next(_counter)))), repeat=opts.repeat)
        hot_spec = _schema("hot")
        _admit(manager, hot_spec)
        hit = median_ms(lambda: _admit(manager, hot_spec), repeat=opts.repeat * 20)
        bad = {"grammar": "root ::= missing_rule"}
        first = manager.add("bad0", bad)
        while manager.num_pending:
            manager.step()
        assert manager.add("bad1", bad).cache == "poisoned", first

        def poisoned() -> None:
            out = manager.add(f"p{next(_counter)}", bad)
            assert out.cache == "poisoned"

        poison = median_ms(poisoned, repeat=opts.repeat * 20)

        def dedup() -> None:
            spec = _schema(f"d{next(_counter)}")
            ids = [f"d{next(_counter)}" for _ in range(opts.n)]
            for rid in ids:
                manager.add(rid, spec)
            left = set(ids)
            while left:
                for o in manager.step():
                    left.discard(o.request_id)
                    manager.finish(o.request_id)
                time.sleep(0.0002)

        backend = XGrammarBackend(tok)
        pool = ThreadPoolExecutor(cfg.pool_size)

        def no_dedup() -> None:
            spec = validate_spec(_schema(f"n{next(_counter)}"), cfg, vocab=tok.name)
            list(pool.map(lambda _: backend(spec), range(opts.n)))

        with_dedup = median_ms(dedup, repeat=max(3, opts.repeat // 3), warmup=1)
        without = median_ms(no_dedup, repeat=max(3, opts.repeat // 3), warmup=1)
        pool.shutdown()
        thread_ms, ship_ms, n_ship = _serialization_overhead(
            tok, opts.schemas, opts.data or dev_data_dir()
        )
    finally:
        manager.close()
    return [
        BenchRecord.compare(
            "cache_hit_admission",
            "cold_compile",
            hit,
            cold,
            target_ms=0.5,
            note="add + local step, key in compile cache",
        ),
        BenchRecord.compare(
            "poisoned_repeat",
            "cold_compile",
            poison,
            cold,
            target_ms=1.0,
            note="add of an INVALID-poisoned key; no compile",
        ),
        BenchRecord.compare(
            f"dedup_{opts.n}_identical",
            f"no_dedup_{opts.n}_identical",
            with_dedup,
            without,
            note=f"{opts.n} concurrent requests, one new key, pool={cfg.pool_size}",
        ),
        BenchRecord.compare(
            "thread_compile",
            "subprocess_compile",
            thread_ms,
            ship_ms,
            note=f"median of {n_ship} dev schemas; baseline adds serialize+deserialize",
        ),
    ]
