"""Masks through SGLang's own batch code: ours equal SGLang's xgrammar backend on dev schemas.

Each step runs the real ``SamplingBatchInfo.update_regex_vocab_mask`` (the
batched fill) and ``GrammarMask.apply`` twice over the same rows, once
with our grammar objects and once with SGLang's ``XGrammarGrammarBackend``'s,
fills a second time with no token in between (a chunked prefill's middle
chunk), compares jump-forward, then accepts the same token in both. The
batch holder is a plain object with the four fields that method reads
(``SamplingBatchInfo`` itself needs a whole ``ScheduleBatch``).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("sglang")

import torch

from tests import dev_data
from tests.integrations.sglang.host import host
from tests.load import scaled

pytestmark = pytest.mark.timeout(300)

# Dev schemas that compile in well under a second with the Qwen2.5 vocabulary.
IDS = (
    "Github_trivial/o32735",
    "Github_trivial/o4050",
    "Github_easy/o69751",
    "Github_medium/o79651",
    "Github_medium/o76459",
    "Github_hard/o83745",
    "Github_hard/o41203",
    "calculate_area_59aeb8e9",
    "generate_password_7cc4d",
    "Kubernetes/kb_943_Normalized",
    "Kubernetes/kb_866_Normalized",
    "WashingtonPost/wp_70_Normalized",
    "WashingtonPost/wp_108_Normalized",
    "JsonSchemaStore/jsinspectrc",
    "JsonSchemaStore/importmap",
    "MCPspec/ListToolsRequest",
    "MCPspec/CancelledNotification",
    "BFCL_simple/BFCL_simple_313",
    "BFCL_multiple/BFCL_multiple_95",
)
STEPS = 40
# SGLang's two structural-tag forms: the legacy structures/triggers and xgrammar's format.
LEGACY_TAG = {
    "structures": [{"begin": "<f>", "schema": {"type": "object"}, "end": "</f>"}],
    "triggers": ["<f>"],
}
TAG = {
    "type": "structural_tag",
    "format": {
        "type": "triggered_tags",
        "triggers": ["<f>"],
        "tags": [
            {
                "begin": "<f>",
                "content": {"type": "json_schema", "json_schema": {"type": "object"}},
                "end": "</f>",
            }
        ],
    },
}


def _schemas() -> list[str]:
    return [json.dumps(dev_data.schema(want)) for want in IDS]


def _grammars(backend, keys):
    """Grammar objects for ``keys``, through SGLang's own Future path."""
    out = []
    for key in keys:
        value, hit = backend.get_cached_or_future_value(key, False)
        out.append(value if hit else value.result(timeout=scaled(120)))
    return out


def _fill(grammars, vocab_size):
    from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo

    batch = SimpleNamespace(
        grammars=grammars,
        vocab_size=vocab_size,
        temperatures=torch.ones(len(grammars), 1),
        device="cpu",
    )
    SamplingBatchInfo.update_regex_vocab_mask(batch)
    return batch.grammar_mask


@pytest.fixture(scope="module")
def backends():
    from sglang.srt.constrained.xgrammar_backend import XGrammarGrammarBackend

    from gramcoord.integrations.sglang.backend import SglangBackend

    h = host()
    ours = SglangBackend(h.tokenizer, h.vocab_size, h.eos_token_ids)
    theirs = XGrammarGrammarBackend(
        h.tokenizer, vocab_size=h.vocab_size, model_eos_token_ids=list(h.eos_token_ids)
    )
    yield ours, theirs
    ours.close()


def test_masks_equal_sglangs_xgrammar_backend(backends) -> None:
    from sglang.srt.constrained.base_grammar_backend import BaseGrammarObject, GrammarMask

    ours_b, theirs_b = backends
    vocab = host().vocab_size
    keys = [("json", s) for s in _schemas()] + [
        ("regex", r"[a-z]{2,6}-\d{3}"),
        ("ebnf", 'root ::= "id: " [0-9]+ ("," [a-z]+)*'),
        ("json", "$$ANY$$"),
        ("structural_tag", json.dumps(LEGACY_TAG)),
        ("structural_tag", json.dumps(TAG)),
    ]
    ours = _grammars(ours_b, keys)
    theirs = _grammars(theirs_b, keys)
    assert [type(g).__name__ for g in ours] == ["SglangGrammar"] * len(keys)
    assert all(isinstance(g, BaseGrammarObject) for g in ours)
    gen = torch.Generator().manual_seed(0)
    steps = 0
    for _ in range(STEPS):
        live = [i for i, g in enumerate(theirs) if not g.is_terminated()]
        if not live:
            break
        mask_o = _fill([ours[i] for i in live], vocab)
        mask_t = _fill([theirs[i] for i in live], vocab)
        assert torch.equal(mask_o.vocab_mask, mask_t.vocab_mask)
        again = _fill([ours[i] for i in live], vocab)  # no accept in between
        assert torch.equal(again.vocab_mask, mask_o.vocab_mask)
        logits = torch.randn(len(live), vocab, generator=gen)
        ref = logits.clone()
        GrammarMask(mask_o.grammar, mask_o.vocab_mask).apply(logits)
        mask_t.apply(ref)
        assert torch.equal(logits, ref)
        for row, i in enumerate(live):
            assert ours[i].try_jump_forward(None) == theirs[i].try_jump_forward(None)
            token = int(torch.argmax(logits[row]))
            ours[i].accept_token(token)
            theirs[i].accept_token(token)
            assert ours[i].current_token == theirs[i].current_token == token
            assert ours[i].is_terminated() == theirs[i].is_terminated()
        steps += len(live)
    assert steps > 100


def test_grammar_object_members_sglang_reads(backends) -> None:
    ours_b, _ = backends
    (g,) = _grammars(ours_b, [("regex", r"(yes|no)!")])
    assert g.current_token is None and not g.finished
    g.maybe_init_reasoning(False)
    assert g.grammar_stats is not None and g.grammar_stats.dispatch_type == "regex"
    mask = g.allocate_vocab_mask(vocab_size=g.vocab_size, batch_size=2, device="cpu")
    g.fill_vocab_mask(mask, 0)
    g.reset_vocab_mask(mask)
    assert bool((mask == -1).all())
    tok = host().tokenizer
    ids = tok.encode("yes", add_special_tokens=False)
    for t in ids:
        g.accept_token(t)
    with pytest.raises(ValueError, match="Tokens not accepted"):
        g.accept_token(tok.encode("zzz", add_special_tokens=False)[0])
    g.rollback(len(ids))
    clone = g.copy()
    assert clone is not g and clone.current_token is None
    helper = clone.try_jump_forward(tok)
    assert helper is None or clone.jump_forward_str_state(helper)[0]
    # A cache hit comes back at once, as SGLang's cache does.
    value, hit = ours_b.get_cached_or_future_value(("regex", r"(yes|no)!"), False)
    assert hit and value.grammar_stats.is_cache_hit


@pytest.mark.parametrize(
    "key",
    [
        pytest.param(("regex", "(unclosed"), id="bad-regex"),
        pytest.param(("json", "{not json"), id="bad-json"),
        pytest.param(("json", '{"type": "string", "pattern": "a\\u0000b"}'), id="nul-pattern"),
        pytest.param(("no_such_kind", "x"), id="unknown-kind"),
    ],
)
def test_bad_input_becomes_sglangs_invalid_grammar(backends, key) -> None:
    from sglang.srt.constrained.base_grammar_backend import InvalidGrammarObject

    ours_b, _ = backends
    value, hit = ours_b.get_cached_or_future_value(key, False)
    grammar = value if hit else value.result(timeout=scaled(60))
    assert isinstance(grammar, InvalidGrammarObject)
    assert grammar.error_message


def _traverse_tree():
    """SGLang's own ``traverse_tree``: imported, or, where its module's imports
    (speculative kernels) cannot load here, compiled from SGLang's installed
    source file, unchanged."""
    try:
        from sglang.srt.speculative.spec_utils import traverse_tree
    except Exception:
        import ast
        import importlib.util
        from typing import Optional

        from sglang.srt.constrained.base_grammar_backend import BaseGrammarObject

        path = importlib.util.find_spec("sglang.srt.speculative.spec_utils").origin
        tree = ast.parse(Path(path).read_text())
        node = next(n for n in tree.body if getattr(n, "name", "") == "traverse_tree")
        scope = {"torch": torch, "BaseGrammarObject": BaseGrammarObject, "Optional": Optional}
        exec(compile(ast.Module([node], []), path, "exec"), scope)
        traverse_tree = scope["traverse_tree"]
    return traverse_tree


def test_sglangs_traverse_tree_over_our_grammar(backends) -> None:
    ours_b, theirs_b = backends
    key = ("regex", r"(ab|ac|b)c?d")
    (ours,) = _grammars(ours_b, [key])
    (theirs,) = _grammars(theirs_b, [key])
    tok = host().tokenizer
    a, b, c, d = (tok.encode(s, add_special_tokens=False)[0] for s in "abcd")
    # Tree: root -> a -> (b -> d, c), sibling of a: b.
    draft = torch.tensor([0, a, b, d, c, b])
    next_token = torch.tensor([1, 2, -1, -1, -1, -1])
    next_sibling = torch.tensor([-1, 5, 4, -1, -1, -1])
    next_token[2] = 3
    traverse = _traverse_tree()
    masks = []
    for g in (ours, theirs):
        mask = g.allocate_vocab_mask(vocab_size=g.vocab_size, batch_size=6, device="cpu")
        traverse(next_token, next_sibling, draft, g, mask, vocab_size=g.vocab_size)
        masks.append(mask)
        assert g.current_token is not None and not g.is_terminated()
    assert torch.equal(masks[0], masks[1])


@pytest.mark.parametrize("char", ["\t", "\x01"], ids=["tab", "x01"])
def test_a_bounded_string_refuses_a_raw_control_character(backends, char) -> None:
    # SGLang's xgrammar backend lets it into a string with maxLength (xgrammar
    # 0.2.9); ours compiles the same key with the class of plain strings.
    ours_b, theirs_b = backends
    schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 8}}}
    key = ("json", json.dumps(schema))
    (ours,) = _grammars(ours_b, [key])
    (theirs,) = _grammars(theirs_b, [key])
    tok = host().tokenizer
    for t in tok.encode('{"s": "a', add_special_tokens=False):
        ours.accept_token(t)
        theirs.accept_token(t)
    (control,) = tok.encode(char, add_special_tokens=False)
    theirs.accept_token(control)
    with pytest.raises(ValueError, match="Tokens not accepted"):
        ours.accept_token(control)


@pytest.mark.parametrize(
    ("schema", "breach", "valid"),
    [
        # minLength on a schema without type: it constrains strings only.
        pytest.param({"minLength": 3}, '"ab"', '"abc"', id="untyped-keyword"),
        # vLLM's tool_choice="required" shape: the siblings hold in every branch.
        pytest.param(
            {
                "type": "object",
                "properties": {"a": {"type": "integer"}},
                "anyOf": [{"required": ["a"]}, {"required": ["b"]}],
            },
            '{"c": 1}',
            '{"a": 1}',
            id="siblings-of-anyOf",
        ),
    ],
)
def test_a_schema_gramcoord_rewrites_is_enforced_whole(backends, schema, breach, valid) -> None:
    # SGLang's xgrammar backend drops what xgrammar does not enforce and lets
    # the breach through; ours compiles the equivalent schema xgrammar enforces.
    ours_b, theirs_b = backends
    key = ("json", json.dumps(schema))
    (theirs,) = _grammars(theirs_b, [key])
    eos = next(iter(host().eos_token_ids))

    def ends(grammar, text: str) -> bool:
        return grammar.matcher.accept_string(text) and grammar.matcher.accept_token(eos)

    assert ends(theirs, breach)  # the gap gramcoord closes
    for text, ok in ((breach, False), (valid, True)):
        (ours,) = _grammars(ours_b, [key])
        assert ours.check is None  # enforced whole: no end check needed
        assert ends(ours, text) is ok
