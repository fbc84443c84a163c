"""The ``hf`` model: KV cache, device and dtype, chat template, vocabulary check.

Every model here is a tiny random-weight Qwen2 built in process; the small
Hugging Face tokenizer (256 byte tokens and three specials) is built with
the ``tokenizers`` package and saved to a temporary directory. Nothing is
downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from gramcoord.engine.decoder import GreedyDecoder
from gramcoord.engine.drafter import ReplayDrafter
from gramcoord.engine.hf_checks import (
    chat_template,
    check_hf_model,
    device_problem,
    tokenizer_ids,
)
from gramcoord.engine.models import (
    HFModel,
    ModelRequest,
    build_tiny_qwen2,
    make_model,
)
from gramcoord.rank_worker.config import ModelConfig, TokenizerConfig
from gramcoord.rank_worker.grammars.tokenizer import load_tokenizer
from gramcoord.rank_worker.masks.grammar_state import GrammarState
from gramcoord.rank_worker.masks.jump_forward import JumpForward

pytest.importorskip("transformers")

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
QWEN_IDS = 151_665  # 151,643 base tokens + 22 specials


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def save_small_tokenizer(path: Path, *, template: str | None) -> Path:
    """A byte-level BPE tokenizer of 256 byte tokens + 3 specials (259 ids)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tk = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tk,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )
    if template:
        hf.chat_template = template
    hf.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def small_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("small-hf")
    build_tiny_qwen2(root / "model", vocab_size=320)
    build_tiny_qwen2(root / "narrow", vocab_size=200)
    return {
        "chat": save_small_tokenizer(root / "chat", template=CHATML),
        "plain": save_small_tokenizer(root / "plain", template=None),
        "model": root / "model",
        "narrow": root / "narrow",
    }


@pytest.fixture(scope="module")
def tiny_qwen():
    return build_tiny_qwen2()


def pair(model, vocab_size: int) -> tuple[HFModel, HFModel]:
    """(with the KV cache, without) over one model object."""
    return (
        HFModel(model, vocab_size=vocab_size, kv_cache=True),
        HFModel(model, vocab_size=vocab_size, kv_cache=False),
    )


# -- KV cache ------------------------------------------------------------------------


def test_cache_logits_equal_recomputed_logits_through_every_kind_of_step(tiny_qwen):
    cached, plain = pair(tiny_qwen, 151_936)
    a = ModelRequest("a", prompt_ids=(100, 200, 300, 400))
    b = ModelRequest("b", prompt_ids=(7, 8))
    steps = [
        [(a, []), (b, [])],  # prompts
        [(a, [5]), (b, [9])],  # one token each
        [(a, [5, 6]), (b, [9, 10, 11, 12])],  # b jumped forward three tokens
        [(a, [5, 6, 7]), (a, [5, 6, 7, 8]), (a, [5, 6, 7, 8, 9])],  # a: two drafts
        [(a, [5, 6, 7, 8, 4])],  # draft 8 kept, 9 rejected, bonus 4
        [(b, [9, 10, 13, 14])],  # b retokenized its last two tokens
        [(b, [9])],  # a deep rollback
        [(b, [])],  # back to the prompt alone
        [(ModelRequest("b", prompt_ids=(1, 2, 3)), [9])],  # id reused, other prompt
        [(ModelRequest("e"), []), (ModelRequest("e"), [3])],  # no prompt: BOS
    ]
    for rows in steps:
        got, want = cached.logits(rows), plain.logits(rows)
        assert got.shape == want.shape and got.dtype == torch.float32
        close(got, want)
        assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert cached.cache_hits >= 6 and cached.cache_rollbacks >= 4
    assert plain.cached_requests == 0


def test_cache_holds_only_what_is_in_use(tiny_qwen):
    model = HFModel(tiny_qwen, kv_cache=True, idle_calls=2)
    a, b = ModelRequest("a", prompt_ids=(1, 2)), ModelRequest("b", prompt_ids=(3,))
    model.logits([(a, []), (b, [])])
    model.logits([(a, [4])])
    assert model.cached_requests == 2
    model.logits([(a, [4, 5])])  # b idle for two calls: dropped
    assert model.cached_requests == 1
    misses = model.cache_misses
    close(model.logits([(b, [6])]), HFModel(tiny_qwen).logits([(b, [6])]))
    assert model.cache_misses == misses + 1
    model.forget()
    assert model.cached_requests == 0


def test_a_cache_that_cannot_be_cropped_is_rebuilt(tiny_qwen, monkeypatch):
    from transformers import DynamicCache

    monkeypatch.setattr(DynamicCache, "is_croppable", property(lambda self: False))
    cached, plain = pair(tiny_qwen, 151_936)
    a = ModelRequest("a", prompt_ids=(10, 11, 12))
    for rows in ([(a, [1, 2, 3])], [(a, [1, 5])], [(a, [1, 5, 6])]):
        close(cached.logits(rows), plain.logits(rows))
    assert cached.cache_rollbacks == 1 and cached.cache_misses == 2 and cached.cache_hits == 1


@pytest.mark.parametrize("mode", ["exact", "greedy"])
def test_greedy_runs_are_unchanged_by_the_cache(qwen_tokenizer, dev_pool, tiny_qwen, mode):
    """Real schemas, jump-forward (greedy mode retokenizes) and replayed drafts
    (the reference with deliberate errors; the random model rejects most):
    the same tokens with the cache as without, and the cache was rolled back."""
    vocab = qwen_tokenizer.vocab_size
    cached, plain = pair(tiny_qwen, vocab)
    jf = JumpForward(qwen_tokenizer, mode=mode)
    decoder = GreedyDecoder(
        qwen_tokenizer, num_speculative_tokens=2, max_tokens=40, jump_forward=jf
    )
    for sid, compiled, text in dev_pool[False][:4]:
        request = ModelRequest(sid, prompt_ids=tuple(qwen_tokenizer.encode(f"Fill {sid}: ")))
        results = [
            decoder.decode(
                GrammarState(compiled),
                model,
                request,
                ReplayDrafter(qwen_tokenizer, text, request_id=sid),
            )
            for model in (cached, plain)
        ]
        assert results[0].token_ids == results[1].token_ids, sid
        assert results[0].finish_reason == results[1].finish_reason
    assert cached.cache_hits > 0 and cached.cache_rollbacks > 0
    assert jf.stats.num_jumps > 0


# -- make_model: device, dtype, vocabulary, chat template ---------------------------------


def test_make_model_takes_device_dtype_and_cache_from_the_config(small_dirs):
    tok = load_tokenizer(TokenizerConfig(name="hf", path=str(small_dirs["plain"])))
    path = str(small_dirs["model"])
    model = make_model(ModelConfig(kind="hf", path=path), tok)
    assert isinstance(model, HFModel) and model.kv_cache
    assert next(model.model.parameters()).dtype == torch.float32
    assert model.device == torch.device("cpu") and model.vocab_size == tok.vocab_size == 259
    half = make_model(ModelConfig(kind="hf", path=path, dtype="bfloat16", kv_cache=False), tok)
    assert next(half.model.parameters()).dtype == torch.bfloat16 and not half.kv_cache
    rows = [(ModelRequest("r", prompt_ids=(1, 2, 3)), [4])]
    assert half.logits(rows).dtype == torch.float32
    auto = make_model(ModelConfig(kind="hf", path=path, dtype="auto"), tok)
    assert next(auto.model.parameters()).dtype == torch.float32


def test_model_config_checks_the_device():
    for device in ("cpu", "cuda", "cuda:1"):
        assert ModelConfig(kind="hf", path="m", device=device).device == device
    with pytest.raises(ValueError, match=r"model\.device must be"):
        ModelConfig(kind="hf", path="m", device="gpu")
    with pytest.raises(ValueError, match="chat_template is only used"):
        ModelConfig(chat_template=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_a_cuda_device_without_cuda_is_refused_before_the_ranks(small_dirs):
    assert "needs CUDA" in device_problem("cuda")
    config = ModelConfig(kind="hf", path=str(small_dirs["model"]), device="cuda:0")
    problem = check_hf_model(config, TokenizerConfig(name="hf", path=str(small_dirs["plain"])))
    assert problem is not None and "model.device 'cuda:0' needs CUDA" in problem


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_logits_match_cpu(tiny_qwen, qwen_tokenizer):
    import copy

    gpu = HFModel(copy.deepcopy(tiny_qwen), device="cuda", kv_cache=True)
    cpu = HFModel(tiny_qwen, kv_cache=True)
    a = ModelRequest("a", prompt_ids=(100, 200, 300))
    for rows in ([(a, [])], [(a, [5])], [(a, [5, 6]), (a, [5, 6, 7])], [(a, [5, 8])]):
        got = gpu.logits(rows)
        assert got.device.type == "cuda"
        torch.testing.assert_close(got.cpu(), cpu.logits(rows), rtol=1e-3, atol=1e-3)
    assert device_problem("cuda") is None
    assert "CUDA device(s)" in device_problem(f"cuda:{torch.cuda.device_count()}")


def test_a_model_smaller_than_the_vocabulary_is_refused(small_dirs, tiny_qwen):
    narrow = str(small_dirs["narrow"])
    tok_config = TokenizerConfig(name="hf", path=str(small_dirs["plain"]))
    problem = check_hf_model(ModelConfig(kind="hf", path=narrow), tok_config)
    assert problem is not None
    assert narrow in problem and "200 rows" in problem and "259 ids" in problem
    assert check_hf_model(ModelConfig(kind="hf", path=str(small_dirs["model"])), tok_config) is None
    # The rank refuses it too, instead of an IndexError in F.embedding mid-run.
    tok = load_tokenizer(tok_config)
    assert tokenizer_ids(tok) == 259
    with pytest.raises(ValueError, match=r"200 embedding rows .*\(259 ids\)"):
        make_model(ModelConfig(kind="hf", path=narrow), tok)
    # The real Qwen2.5 vocabulary: a model cut at 151,000 rows is refused.
    with pytest.raises(ValueError, match="151000 embedding rows"):
        HFModel(build_tiny_qwen2(vocab_size=151_000), tokenizer_ids=QWEN_IDS)
    model = HFModel(tiny_qwen, tokenizer_ids=QWEN_IDS)  # 151,936 rows: fine
    with pytest.raises(ValueError, match="outside the model's 151936 embedding rows"):
        model.logits([(ModelRequest("r"), [151_936])])


def test_check_hf_model_reports_an_unreadable_model(tmp_path):
    problem = check_hf_model(ModelConfig(kind="hf", path=str(tmp_path)), TokenizerConfig())
    assert problem is not None and problem.startswith(f"model.path {tmp_path}: cannot read")
    assert check_hf_model(ModelConfig(), TokenizerConfig()) is None


def test_chat_template_wraps_the_prompt(small_dirs):
    from transformers import AutoTokenizer

    tok = load_tokenizer(TokenizerConfig(name="hf", path=str(small_dirs["chat"])))
    hf = AutoTokenizer.from_pretrained(str(small_dirs["chat"]), local_files_only=True)
    config = ModelConfig(kind="hf", path=str(small_dirs["model"]), chat_template=True)
    assert check_hf_model(config, TokenizerConfig(name="hf", path=str(small_dirs["chat"]))) is None
    model = make_model(config, tok)
    prompt = tuple(tok.encode('Give me {"a": 1}'))
    text = '<|im_start|>user\nGive me {"a": 1}<|im_end|>\n<|im_start|>assistant\n'
    wrapped = hf.encode(text, add_special_tokens=False)
    assert chat_template(tok)(prompt) == wrapped
    assert wrapped[0] == hf.convert_tokens_to_ids("<|im_start|>")
    # The model conditions on the wrapped prompt.
    plain = HFModel(model.model, vocab_size=tok.vocab_size)
    rows = model.logits([(ModelRequest("r", prompt_ids=prompt), [5, 6])])
    close(rows, plain.logits([(ModelRequest("r", prompt_ids=tuple(wrapped)), [5, 6])]))


def test_chat_template_needs_a_template(small_dirs, qwen_tokenizer):
    model = str(small_dirs["model"])
    plain = TokenizerConfig(name="hf", path=str(small_dirs["plain"]))
    problem = check_hf_model(ModelConfig(kind="hf", path=model, chat_template=True), plain)
    assert problem is not None and "has no chat template" in problem
    with pytest.raises(ValueError, match="has no chat template"):
        make_model(ModelConfig(kind="hf", path=model, chat_template=True), load_tokenizer(plain))
    with pytest.raises(ValueError, match="needs a Hugging Face tokenizer"):
        chat_template(qwen_tokenizer)


# -- a whole run ---------------------------------------------------------------------------


def _run(tmp_path: Path, name: str, model_dir: Path, *overrides: str) -> list[dict]:
    from gramcoord.launch.cli import main

    workload = tmp_path / "w.jsonl"
    if not workload.exists():
        records = [
            {"id": "choice", "structured_outputs": {"choice": ["alpha", "beta", "gamma"]}},
            {"id": "regex", "structured_outputs": {"regex": "[a-c]{2,6}-[0-9]{1,3}"}},
            {"id": "json", "structured_outputs": {"json": {"type": "integer"}}},
            {"id": "free", "prompt": "Say something."},
        ]
        for r in records:
            r.setdefault("prompt", f"Answer for {r['id']}.")
            r["max_tokens"] = 16
        workload.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / name
    config = tmp_path / "config.yaml"
    config.write_text("launcher: inline\nscheduler: {max_num_seqs: 4}\n")
    argv = ["run", str(config), "--workload", str(workload), "--out", str(out)]
    settings = [
        "launcher=inline",
        "parallel.dp=1",
        "parallel.tp=1",
        "model.kind=hf",
        f"model.path={model_dir}",
        "grammar.jump_forward=true",
        "grammar.jump_forward_mode=greedy",
        "speculative.num_tokens=2",
        *overrides,
    ]
    for item in settings:
        argv += ["--set", item]
    assert main(argv) == 0
    return [json.loads(line) for line in (out / "outputs.jsonl").read_text().splitlines()]


def test_a_run_gives_the_same_outputs_with_and_without_the_cache(tmp_path, small_dirs):
    tok = ["tokenizer.name=hf", f"tokenizer.path={small_dirs['chat']}"]
    model = small_dirs["model"]
    with_cache = _run(tmp_path, "cache", model, *tok)
    without = _run(tmp_path, "plain", model, *tok, "model.kv_cache=false")
    assert [o["id"] for o in with_cache] == ["choice", "regex", "json", "free"]
    assert all(o["status"] == "ok" and o["token_ids"] for o in with_cache), with_cache
    assert [o["token_ids"] for o in with_cache] == [o["token_ids"] for o in without]
    templated = _run(tmp_path, "chat", model, *tok, "model.chat_template=true")
    assert all(o["status"] == "ok" for o in templated)


def test_run_refuses_a_narrow_model_before_any_rank(small_dirs, tmp_path):
    from gramcoord.launch.config import load_config
    from gramcoord.launch.run import check_inputs

    workload = tmp_path / "w.jsonl"
    workload.write_text('{"id": "a", "prompt": "hi"}\n')
    settings = ["model.kind=hf", "tokenizer.name=hf", f"tokenizer.path={small_dirs['plain']}"]
    narrow = load_config(None, [*settings, f"model.path={small_dirs['narrow']}"])
    problem = check_inputs(narrow, str(workload))
    assert problem is not None and "200 rows" in problem and "259 ids" in problem
    assert (
        check_inputs(
            load_config(None, [*settings, f"model.path={small_dirs['model']}"]), str(workload)
        )
        is None
    )
