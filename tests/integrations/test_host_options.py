"""Host options without a host: vLLM's ``additional_config["gramcoord"]`` check, hints per host.

``integrations.vllm.options`` imports no vLLM, so its parsing is tested here
in the main suite; the hook that runs it at an engine's start is tested
with the real engine (``tests/integrations/vllm/test_failures.py``).
"""

from __future__ import annotations

import pytest

from gramcoord.integrations.vllm.options import (
    ENGINE_OPTIONS,
    OptionsError,
    front_end_config,
    parse,
)
from gramcoord.rank_worker.config import GrammarConfig
from gramcoord.rank_worker.errors import ErrorCode, SpecError
from gramcoord.rank_worker.grammars.spec import validate_spec

# xgrammar would not enforce uniqueItems, and no rewrite can.
UNENFORCED = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}


@pytest.mark.parametrize(
    ("section", "field", "problem"),
    [
        ({"grammar": {"compile_timeout_s": "soon"}}, "gramcoord.grammar.compile_timeout_s", "Expected `float`, got `str`"),
        ({"grammar": {"compile_timeout_s": -1}}, "gramcoord.grammar.compile_timeout_s", "Expected `float` > 0.0"),
        ({"grammar": {"no_such_option": 1}}, "gramcoord.grammar.no_such_option", "unknown field"),
        ({"grammar": {"strict_mode": False}}, "gramcoord.grammar.strict_mode", "not an option of the vLLM plugin"),
        ({"grammar": {"reject_ignored_features": False}}, "gramcoord.grammar.reject_ignored_features", "always false under vLLM"),
        ({"grammar": 3}, "gramcoord.grammar", "expected an object, got int"),
        ({"grammars": {}}, "gramcoord.grammars", "unknown field; use grammar, faults, distributed"),
        ({"faults": {"kill_rank": "one"}}, "gramcoord.faults.kill_rank", "Expected `int | null`, got `str`"),
        ({"faults": {"compile_error": {"pattern": "x"}}}, "gramcoord.faults.compile_error", "missing required field `rank`"),
        ({"faults": {"compile_error": {"pattern": "x", "rank": 0, "typo": 1}}}, "gramcoord.faults.compile_error.typo", "unknown field"),
        ({"distributed": {"step_timeout_s": 0}}, "gramcoord.distributed.step_timeout_s", "Expected `float` > 0.0"),
        ("yes", "gramcoord", "expected an object, got str"),
    ],
)  # fmt: skip
def test_a_bad_section_names_its_field(section, field, problem) -> None:
    with pytest.raises(OptionsError) as info:
        parse(section)
    assert info.value.field == field
    assert problem in info.value.problem, info.value.problem
    assert str(info.value).startswith(f"--additional-config {field}: ")


def test_a_good_section_sets_what_it_names_and_fixes_the_rest() -> None:
    options = parse(
        {
            "grammar": {"compile_timeout_s": 7, "max_pending": 9},
            "faults": {"compile_error": {"pattern": "x", "rank": 0}},
            "distributed": {"step_timeout_s": 5},
        },
        disable_any_whitespace=True,
    )
    assert (options.grammar.compile_timeout_s, options.grammar.max_pending) == (7.0, 9)
    assert not options.grammar.reject_ignored_features and not options.grammar.any_whitespace
    assert options.grammar.compile_mode == "async"
    assert options.faults.compile_error.pattern == "x"
    assert options.distributed.step_timeout_s == 5.0
    assert parse(None) == parse({})
    assert set(GrammarConfig.__struct_fields__) >= ENGINE_OPTIONS


def _refusal(config: GrammarConfig) -> str:
    with pytest.raises(SpecError) as info:
        validate_spec({"json": UNENFORCED}, config)
    assert info.value.code == ErrorCode.schema_unsupported_feature
    return info.value.message


def test_the_refusal_hint_can_be_followed_on_each_host() -> None:
    # Our runner: the YAML field it names exists and accepts the schema.
    ours = _refusal(GrammarConfig(reject_ignored_features=True))
    assert ours.endswith("set grammar.reject_ignored_features=false to accept them unenforced")
    validate_spec({"json": UNENFORCED}, GrammarConfig(reject_ignored_features=False))
    # vLLM: served, and its finished output checked against the schema in
    # the engine; the option is refused at start, naming the field.
    served = validate_spec({"json": UNENFORCED}, front_end_config(False))
    assert served.end_check and served.warnings[0].startswith("ignored_feature: $: uniqueItems")
    with pytest.raises(OptionsError, match="reject_ignored_features: always false under vLLM"):
        parse({"grammar": {"reject_ignored_features": True}})
