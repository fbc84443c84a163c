"""``docs/configuration.md``, generated from the config structs' comments.

Every field of ``ClusterConfig`` is documented by the comment lines right
above it in its section's source. ``reference()`` renders them as Markdown
tables (one per section); ``page()`` is the whole page, those tables under
a short introduction. A test checks that the committed page is exactly this
text, so the reference cannot drift from the code. Regenerate it with::

    gramcoord config --reference > docs/configuration.md
"""

from __future__ import annotations

import inspect
import re
import typing

import msgspec

from gramcoord.launch.config import ClusterConfig

COMMAND = "gramcoord config --reference > docs/configuration.md"
BEGIN = "<!-- config-reference: begin -->"
END = "<!-- config-reference: end -->"
# The page's text above the tables (Markdown; links relative to docs/).
INTRO = f"""\
# Configuration

<!-- Generated from the comments above each field in the code
(launch/config.py and each package's config.py) by
`{COMMAND}`.
Edit those comments, not this file: tests/launch/test_config_doc.py fails
when the two differ. -->

A cluster config is YAML (`configs/*.yaml`, listed in
[running.md](running.md#shipped-configs)). It decodes into frozen, typed
msgspec sections, each owned by its package: `parallel` and `distributed` by
`coordinator/config.py`; `transport` by `sync/config.py`; `grammar`,
`speculative`, `sampling`, `scheduler`, `tokenizer`, `model` and `faults` by
`rank_worker/config.py`; `launcher`, `workload` and `output` by
`launch/config.py`.

- A misspelt key, a wrong type or a value out of range names its field path
  (`$.grammar.compile_timeout_s`) and exits 2 before any process starts. An
  enum's error lists its choices.
- Any field can be overridden on the command line with
  `--set section.field=value` (the value is parsed as YAML). A bad `--set`
  is blamed on that `--set`, not on the file.
- `gramcoord config CONFIG [--set ...]` prints the resolved config as JSON;
  `gramcoord config --reference` prints this page.
- Inside vLLM, `additional_config={{"gramcoord": {{"grammar": {{...}}, "faults": {{...}}}}}}`
  sets the engine side: only the `grammar` fields that do not change which
  requests are accepted ([vllm.md](vllm.md#options)).

Every field, its default and what it means:
"""


def field_comments(cls: type) -> dict[str, str]:
    """Field name -> the comment block just above its definition."""
    lines = inspect.getsource(cls).splitlines()
    out: dict[str, str] = {}
    block: list[str] = []
    for line in lines:
        stripped = line.strip()
        if stripped.startswith("#"):
            block.append(stripped.lstrip("#").strip())
            continue
        m = re.match(r"^\s{4}(\w+)\s*:", line)
        if m and block:
            out[m.group(1)] = " ".join(block)
        block = []
    return out


def _default(value: object) -> str:
    if isinstance(value, msgspec.Struct):
        return "(section)"
    if value is msgspec.NODEFAULT:
        return "required"
    return f"`{msgspec.json.encode(value).decode()}`"


def _optional_struct(tp: object) -> type | None:
    """The struct inside ``Struct | None``, else None."""
    args = typing.get_args(tp)
    structs = [a for a in args if isinstance(a, type) and issubclass(a, msgspec.Struct)]
    return structs[0] if len(structs) == 1 and type(None) in args else None


def _rows(cls: type, prefix: str) -> list[tuple[str, str, str]]:
    comments = field_comments(cls)
    hints = typing.get_type_hints(cls, include_extras=False)
    rows = []
    for f in msgspec.structs.fields(cls):
        name = f.name
        value = f.default if f.default_factory is msgspec.NODEFAULT else f.default_factory()
        if isinstance(value, msgspec.Struct):
            rows += _rows(type(value), f"{prefix}{name}.")
            continue
        rows.append((f"{prefix}{name}", _default(value), comments.get(name, "")))
        inner = _optional_struct(hints.get(name))
        if value is None and inner is not None:
            # An optional sub-section (e.g. a fault): its fields, when set.
            rows += _rows(inner, f"{prefix}{name}.")
    return rows


def reference() -> str:
    """Markdown tables: one per top-level section, every field with its default."""
    top = ClusterConfig()
    comments = field_comments(ClusterConfig)
    parts = []
    for name in ClusterConfig.__struct_fields__:
        value = getattr(top, name)
        if isinstance(value, msgspec.Struct):
            rows = _rows(type(value), f"{name}.")
        else:
            rows = [(name, _default(value), comments.get(name, ""))]
        table = ["| field | default | meaning |", "|---|---|---|"]
        table += [f"| `{f}` | {d} | {c.replace('|', '/')} |" for f, d, c in rows]
        parts.append(f"**`{name}`**\n\n" + "\n".join(table))
    return "\n\n".join([BEGIN, *parts, END])


def page() -> str:
    """``docs/configuration.md`` as ``gramcoord config --reference`` prints it."""
    return f"{INTRO}\n{reference()}\n"


if __name__ == "__main__":
    print(page(), end="")
