"""A griffe extension: render free-standing ``>>>`` doctest blocks as Python code.

Our docstrings put their examples straight into the prose, as doctest blocks (``>>>`` /
``...`` lines and their expected output, up to a blank line), so that ``help()`` reads
naturally and ``doctest`` runs them. Google-style parsing only treats such blocks as code inside
an ``Examples:`` section; elsewhere Markdown would read them as a paragraph (and ``x[0][1]`` as
a link). This wraps every block that is not already in an ``Examples:`` section in a fence,
and turns Sphinx roles (``:func:`alloc```) into code spans.
"""

from __future__ import annotations

import re

import griffe

_SECTION = re.compile(r"^(\s*)Examples?:\s*$")
_ROLE = re.compile(r":(?:func|class|meth|attr|mod|data|exc|obj):`~?([^`]+)`")


def fence_doctests(text: str) -> str:
    out: list[str] = []
    lines = text.splitlines()
    i = 0
    section_indent = None  # indent of an enclosing "Examples:" header
    while i < len(lines):
        line = lines[i]
        stripped = line.lstrip()
        indent = len(line) - len(stripped)
        if section_indent is not None and stripped and indent <= section_indent:
            section_indent = None
        m = _SECTION.match(line)
        if m:
            section_indent = len(m.group(1))
        if stripped.startswith(">>>") and section_indent is None:
            pad = line[:indent]
            block = []
            while i < len(lines) and lines[i].strip():
                block.append(lines[i][indent:] if lines[i].startswith(pad) else lines[i].lstrip())
                i += 1
            out += [pad + "```pycon", *(pad + b for b in block), pad + "```"]
            continue
        out.append(line)
        i += 1
    return "\n".join(out)


class DoctestBlocks(griffe.Extension):
    def on_instance(self, *, node, obj, agent, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _ROLE.sub(r"``\1``", fence_doctests(obj.docstring.value))
