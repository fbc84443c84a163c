"""The README's config reference, generated from the config structs' comments.

Every field of ``ClusterConfig`` is documented by the comment lines right
above it in its section's source. ``reference()`` renders them as Markdown
tables (one per section); a test checks that the README embeds exactly this
text, so the reference cannot drift from the code. Print it with::

    gramcoord config --reference
"""

from __future__ import annotations

import inspect
import re

import msgspec

from gramcoord.launch.config import ClusterConfig

BEGIN = "<!-- config-reference: begin (gramcoord config --reference) -->"
END = "<!-- config-reference: end -->"


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


def _rows(cls: type, prefix: str) -> list[tuple[str, str, str]]:
    comments = field_comments(cls)
    defaults = cls()
    rows = []
    for name in cls.__struct_fields__:
        value = getattr(defaults, name)
        if isinstance(value, msgspec.Struct):
            rows += _rows(type(value), f"{prefix}{name}.")
            continue
        rows.append((f"{prefix}{name}", _default(value), comments.get(name, "")))
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


if __name__ == "__main__":
    print(reference())
