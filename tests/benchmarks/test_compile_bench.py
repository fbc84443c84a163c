"""``gramcoord bench compile``'s poisoned-repeat rows where vLLM is missing.

Their ``vllm_refail`` baseline is vLLM's own validation (``VllmRefail``;
checked with vLLM in ``tests/integrations/vllm/test_bench_baselines.py``):
without vLLM those rows say they need it, and the SGLang rows still measure
ours on every bad spec. With vLLM the same check runs in the vLLM suite.
"""

from __future__ import annotations

import importlib.util

from gramcoord.benchmarks import compile as bench
from gramcoord.launch.workload import dev_data_dir
from gramcoord.rank_worker.config import GrammarConfig
from gramcoord.rank_worker.grammars.manager import GrammarManager


def test_poisoned_rows_skip_vllm_where_it_is_missing(qwen_tokenizer):
    check_poisoned_rows(qwen_tokenizer)


def check_poisoned_rows(qwen_tokenizer) -> None:
    """Both rows per bad-spec set; the vLLM ones measured or skipped as vLLM is here
    or not (the vLLM suite runs this with vLLM)."""
    manager = GrammarManager(GrammarConfig(num_compile_workers=1), qwen_tokenizer)
    try:
        rows = bench._poison_rows(manager, qwen_tokenizer, dev_data_dir(), repeat=1)
    finally:
        manager.close()
    by = {(r.name, r.baseline): r for r in rows}
    names = {"poisoned_repeat_ebnf", "poisoned_repeat_dev"}
    assert {n for n, _ in by} == names
    missing = importlib.util.find_spec("vllm") is None
    for name in names:
        vllm, sglang = by[name, "vllm_refail"], by[name, "sglang_cached_invalid"]
        assert (vllm.skipped is not None) == missing
        assert sglang.skipped is None and sglang.median_ms > 0 and sglang.met is not None
    if missing:
        assert by["poisoned_repeat_ebnf", "vllm_refail"].skipped.startswith("needs vLLM")
        n_bad = len(bench._bad_dev_specs(dev_data_dir()))
        assert by["poisoned_repeat_dev", "sglang_cached_invalid"].note.startswith(f"{n_bad} bad")
