"""A spec text is validated once per process: its verdict is remembered (``spec._Verdicts``).

The passes run on a miss only; a hit returns the same spec, warnings,
refusal and bound as a fresh validation would. An object-valued schema is
held by its JSON text when that text stands for it exactly (as a workload
passes a schema); one the text would change (an int
key, a tuple, NaN) is validated every time. The bound on held text stays
exact.
"""

from __future__ import annotations

import json

import pytest

from gramcoord.rank_worker.config import GrammarConfig
from gramcoord.rank_worker.errors import ErrorCode, SpecError
from gramcoord.rank_worker.grammars import spec as spec_module
from gramcoord.rank_worker.grammars.spec import TokenBudget, admit, validate_spec

WIDE = json.dumps(
    {
        "type": "object",
        "properties": {f"p{i}": {"type": "string", "minLength": 40} for i in range(40)},
        "required": [f"p{i}" for i in range(40)],
    }
)
# Accepted with a warning: the grammar relaxes the oneOf, the output is end-checked.
WARNED = json.dumps({"oneOf": [{"type": "integer"}, {"type": "number"}]})
REFUSED = json.dumps({"type": "string", "format": "no-such-format", "not": {"const": "a"}})


@pytest.fixture
def passes(monkeypatch) -> list[str]:
    """Fresh verdicts, and the texts the passes ran on (``_checked_text`` calls)."""
    monkeypatch.setattr(spec_module, "_verdicts", spec_module._Verdicts())
    ran: list[str] = []
    original = spec_module._checked_text

    def counted(spec, config, strict):
        ran.append(spec.json if isinstance(spec.json, str) else repr(spec.json))
        return original(spec, config, strict)

    monkeypatch.setattr(spec_module, "_checked_text", counted)
    return ran


def _fresh(raw, config, **kw):
    """The verdict of a process that never saw the spec."""
    held = spec_module._verdicts
    spec_module._verdicts = spec_module._Verdicts()
    try:
        return admit(raw, config, **kw)
    finally:
        spec_module._verdicts = held


def test_a_text_spec_is_validated_once_and_the_hit_equals_a_fresh_verdict(passes):
    config = GrammarConfig()
    first = admit({"json": WIDE}, config, vocab="v")
    again = admit(json.dumps({"json": WIDE}), config, vocab="v")
    assert passes == [WIDE]
    assert again == first == _fresh({"json": WIDE}, config, vocab="v")


def test_warnings_come_back_whole_and_a_caller_cannot_change_the_held_ones(passes):
    config = GrammarConfig(reject_ignored_features=False)
    first = validate_spec({"json": WARNED}, config)
    assert first.warnings and first.end_check
    assert validate_spec({"json": WARNED}, config) == first
    assert passes == [WARNED]
    made, _ = spec_module._validated_text(
        spec_module._as_spec({"json": WARNED}), config, config.strict_mode
    )
    made.warnings.append("mine")
    assert validate_spec({"json": WARNED}, config).warnings == first.warnings


def test_a_refusal_is_remembered_with_its_code_and_message(passes):
    config = GrammarConfig(reject_ignored_features=True)
    with pytest.raises(SpecError) as first:
        validate_spec({"json": REFUSED}, config)
    with pytest.raises(SpecError) as again:
        validate_spec({"json": REFUSED}, config)
    assert passes == [REFUSED]
    assert (again.value.code, again.value.message) == (first.value.code, first.value.message)
    assert again.value is not first.value


def test_the_config_the_strictness_and_the_vocabulary_each_count(passes):
    lax, strict = GrammarConfig(strict_mode=False), GrammarConfig(strict_mode=True)
    a = validate_spec({"json": WIDE}, lax, vocab="v1")
    b = validate_spec({"json": WIDE}, strict, vocab="v1")
    c = validate_spec({"json": WIDE, "strict_mode": False}, strict, vocab="v1")
    d = validate_spec({"json": WIDE}, lax, vocab="v2")
    # Three keys: (lax, False), (strict, True), (strict, False); the vocabulary
    # is keyed after the held passes, so it never misses.
    assert len(passes) == 3
    assert a.key != b.key and a.key != d.key
    assert c.strict_mode is False
    assert c == _fresh({"json": WIDE, "strict_mode": False}, strict, vocab="v1").spec
    assert d == _fresh({"json": WIDE}, lax, vocab="v2").spec


def test_an_object_schema_is_validated_once_by_its_exact_text(passes):
    config = GrammarConfig()
    as_object = {"json": json.loads(WIDE)}
    first = admit(as_object, config, vocab="v")
    again = admit({"json": json.loads(WIDE)}, config, vocab="v")  # an equal, new object
    assert len(passes) == 1
    assert again == first == _fresh(as_object, config, vocab="v")
    # 1 and 1.0 compare equal but are two texts: two verdicts, each its own.
    one = {"json": {"type": "integer", "maximum": 1}}
    one_float = {"json": {"type": "integer", "maximum": 1.0}}
    assert one == one_float
    passes.clear()
    got = [validate_spec(raw, config) for raw in (one, one_float, one, one_float)]
    assert len(passes) == 2
    assert got[0] == got[2] == _fresh(one, config).spec
    assert got[1] == got[3] == _fresh(one_float, config).spec


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "object", "properties": {1: {"type": "string"}}},  # text: {"1": ...}
        {"enum": ("a", "b")},  # text: a list
        {"type": "number", "maximum": float("nan")},  # text: null
    ],
    ids=["int-key", "tuple", "nan"],
)
def test_an_object_its_text_would_change_is_validated_every_time(passes, schema):
    config = GrammarConfig()
    verdicts = []
    for _ in range(2):
        try:
            verdicts.append(validate_spec({"json": schema}, config))
        except SpecError as exc:
            verdicts.append((exc.code, exc.message))
    assert len(passes) == 2 and verdicts[0] == verdicts[1]


def test_the_bound_of_a_held_spec_is_exact_for_every_budget(passes):
    config = GrammarConfig()
    # 40 strings of at least 40 characters: more than 1,600 bytes.
    tight = admit({"json": WIDE}, config, budget=TokenBudget(64, 16))
    roomy = admit({"json": WIDE}, config, budget=TokenBudget(4096, 16))
    tight_again = admit({"json": WIDE}, config, budget=TokenBudget(64, 16))
    assert passes == [WIDE]
    assert tight.unreachable_end is not None and "max_tokens is 64" in tight.unreachable_end
    assert roomy.unreachable_end is None
    assert tight_again == tight == _fresh({"json": WIDE}, config, budget=TokenBudget(64, 16))


def test_choices_and_regexes_are_held_too(passes):
    config = GrammarConfig()
    for _ in range(2):
        assert validate_spec({"choice": ["a", "b"]}, config).kind == "choice"
        assert validate_spec({"regex": "[a-z]+"}, config).kind == "regex"
    assert len(passes) == 2
    with pytest.raises(SpecError) as bad:
        validate_spec({"choice": []}, config)
    assert bad.value.code == ErrorCode.spec_empty_choice


def test_what_is_held_is_bounded_and_the_oldest_goes_first(passes, monkeypatch):
    monkeypatch.setattr(spec_module._Verdicts, "MAX_CHARS", 2000)
    config = GrammarConfig()
    texts = [
        json.dumps({"type": "string", "maxLength": n, "description": "d" * 150}) for n in range(20)
    ]
    for text in texts:
        validate_spec({"json": text}, config)
    held = spec_module._verdicts
    assert held._chars <= 2000 and len(held._held) < len(texts)
    validate_spec({"json": texts[-1]}, config)  # newest: still held
    validate_spec({"json": texts[0]}, config)  # oldest: validated again
    assert passes == [*texts, texts[0]]
    # Larger than its share of the bound: never held.
    huge = json.dumps({"type": "string", "description": "d" * 400})
    validate_spec({"json": huge}, config)
    validate_spec({"json": huge}, config)
    assert passes[-2:] == [huge, huge]


@pytest.mark.parametrize(
    "raw",
    [{"json": [[]]}, {"json": 5}, {"json": None, "choice": ["a"]}, {"structural_tag": {"a": 1}}],
)
def test_values_that_are_not_text_are_validated_as_ever(passes, raw):
    config = GrammarConfig()
    verdicts = []
    for _ in range(2):
        try:
            verdicts.append(validate_spec(raw, config))
        except SpecError as exc:
            verdicts.append((exc.code, exc.message))
    assert verdicts[0] == verdicts[1]
