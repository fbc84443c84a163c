"""The path one spec's admission takes through gramcoord's modules, measured with ``sys.setprofile``.

``entries(fn, ...)`` runs ``fn`` and returns the sequence of gramcoord
modules control *enters by a call* from another module. Each call site
(caller function -> callee function) counts the first time it runs, so a
loop over a schema's nodes reads as one entry, the way a reader following
the code meets it; a return to a caller that is still running is not an
entry; consecutive entries of one module merge. Then:

- **stays**: the length of that sequence;
- **modules**: the distinct modules in it;
- **returns**: stays - modules, the times control came back to a module it
  had left for another.

``python -m tests.rank_worker.grammars.path_measure`` prints the numbers of
``GrammarManager.add``'s admission call (validation, key and the
unreachable-end bound) over the dev schemas.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gramcoord.rank_worker as _rank_worker

# The checkout's root: modules are named by their path below it.
_ROOT = Path(_rank_worker.__file__).resolve().parents[1]
_NOT_OURS = ("tests", ".venv", ".venv-sglang", ".venv-vllm")


def _module_of(filename: str, cache: dict[str, str | None]) -> str | None:
    if filename not in cache:
        name = None
        if not filename.startswith("<"):
            try:
                rel = Path(filename).resolve().relative_to(_ROOT)
            except ValueError:
                rel = None
            if rel is not None and rel.parts[0] not in _NOT_OURS:
                name = rel.with_suffix("").as_posix()
        cache[filename] = name
    return cache[filename]


def entries(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[str]:
    """The gramcoord modules ``fn(*args, **kwargs)`` enters, in order (see the module docstring).

    An exception from ``fn`` ends the trace and is raised again.
    """
    cache: dict[str, str | None] = {}
    seen: set[tuple[Any, Any]] = set()
    path: list[str] = []

    def profile(frame, event, arg):
        if event != "call":
            return
        module = _module_of(frame.f_code.co_filename, cache)
        if module is None:
            return
        caller = frame.f_back
        while caller is not None and _module_of(caller.f_code.co_filename, cache) is None:
            caller = caller.f_back
        if caller is not None and _module_of(caller.f_code.co_filename, cache) == module:
            return
        site = (caller.f_code if caller is not None else None, frame.f_code)
        if site in seen:
            return
        seen.add(site)
        if not path or path[-1] != module:
            path.append(module)

    old = sys.getprofile()
    sys.setprofile(profile)
    try:
        fn(*args, **kwargs)
    finally:
        sys.setprofile(old)
    return path


def numbers(path: list[str]) -> tuple[int, int, int]:
    """(stays, modules, returns) of one path."""
    return len(path), len(set(path)), len(path) - len(set(path))


def admission_path(schema: Any, **options: Any) -> list[str]:
    """The path of ``GrammarManager.add``'s admission call for one JSON schema (refused or not)."""
    from gramcoord.rank_worker.config import GrammarConfig
    from gramcoord.rank_worker.errors import SpecError
    from gramcoord.rank_worker.grammars.spec import TokenBudget, admit

    config = GrammarConfig(**options)
    budget = TokenBudget(max_tokens=256, max_token_bytes=16)

    def run() -> None:
        with contextlib.suppress(SpecError):  # a refusal's path counts too
            admit({"json": schema}, config, vocab="v", budget=budget)

    return entries(run)


def _main() -> None:
    from tests import dev_data

    records = dev_data.records()
    total = [0, 0, 0]
    for record in records:
        for i, n in enumerate(numbers(admission_path(record["schema"]))):
            total[i] += n
    stays, modules, returns = total
    print(f"{len(records)} dev schemas: {stays} stays, {modules} modules, {returns} returns")
    for want in ("Kubernetes/kb_480", "Glaiveai2K/calculate_area", "Github_hard/o14514"):
        record = next(r for r in records if want in r["id"])
        path = admission_path(record["schema"])
        stays, modules, returns = numbers(path)
        shown = " > ".join(p.rsplit("/", 1)[-1] for p in path)
        print(f"{record['id']}: {stays} stays, {modules} modules, {returns} returns: {shown}")


if __name__ == "__main__":
    _main()
