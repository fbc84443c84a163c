"""Admitting one spec is one forward sequence of passes: no module is entered twice.

Measured with ``path_measure.entries`` (``sys.setprofile``) on real dev
schemas: the passes follow each other (parse, canonical form, one walk,
verdict, key, bound), each helper is entered from below its pass, and
control never comes back to a module it had left for another. The
rewrites (``schema_rewrite``) run between the canonical copy and the walk;
the canonical copy of their result is the same call as the first.
"""

from __future__ import annotations

import pytest

from tests import dev_data
from tests.rank_worker.grammars.path_measure import admission_path, numbers

# The passes, in the order their modules are first entered.
PASSES = [
    "rank_worker/grammars/spec",
    "rank_worker/grammars/schema",
    "rank_worker/grammars/schema_tree",
    "rank_worker/grammars/schema_rewrite",
    "rank_worker/grammars/schema_walk",
    "rank_worker/grammars/shortest",
]

CASES = [
    pytest.param("Kubernetes/kb_480", {}, id="refs"),
    pytest.param("Github_hard/o14514", {}, id="oneOf-refs"),
    pytest.param("Glaiveai2K/calculate_area", {}, id="plain"),
    pytest.param("Github_hard/o14514", {"reject_ignored_features": True}, id="refused"),
]


@pytest.mark.parametrize(("want", "options"), CASES)
def test_admission_enters_each_module_once(want, options):
    path = admission_path(dev_data.schema(want), **options)
    assert numbers(path)[2] == 0, path  # no returns
    passes = [p for p in path if p in PASSES]
    assert passes == sorted(passes, key=PASSES.index), path


def test_every_dev_schema_takes_a_forward_path():
    back = {}
    for record in dev_data.records():
        path = admission_path(record["schema"])
        if numbers(path)[2]:
            back[record["id"]] = path
    assert not back, f"{len(back)} schemas come back to a module they left: {next(iter(back))}"
