"""A Griffe extension for the API pages (mkdocs.yml loads it): the package's docstrings write cross-references as
Sphinx roles (``:func:`~.ops.share_codes```) inside Google-style sections, which mkdocstrings would print as raw
text. At build time every role becomes a cross-reference that mkdocs-autorefs resolves to the object's entry on an
API page (a plain code span where the object has no entry: a private helper, torch), and every ``>>>`` example
outside an Examples section becomes a code block. Unknown roles are errors, so a strict build fails on them
(tests/test_docs.py). The docstrings themselves are not changed.

Relative targets follow Python's relative imports from the docstring's module (``.ops`` is a sibling module,
``..linear`` the parent package's), then the module itself, then the documented object (``.method`` in a class).
"""

from __future__ import annotations

import html
import logging
import re
from typing import Any

import griffe

ROLES = ("func", "class", "mod", "meth", "attr", "data", "exc", "obj", "const")
ROLE = re.compile(r":(?P<role>[a-z]+):`(?P<target>[^`]+)`")
PROMPT = re.compile(r"^(?P<indent>\s*)>>> ")
logger = logging.getLogger("mkdocs.plugins.griffe_roles")


class SphinxRoles(griffe.Extension):
    """Sphinx roles to cross-references, loose ``>>>`` examples to code blocks (module docstring)."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        for obj in _walk(pkg):
            if obj.docstring is not None:
                obj.docstring.value = _examples(_roles(obj.docstring.value, obj, pkg))


def _walk(obj: Any) -> Any:
    yield obj
    for member in obj.members.values():
        if not member.is_alias:
            yield from _walk(member)


def _roles(text: str, obj: Any, pkg: griffe.Module) -> str:
    def replace(match: re.Match) -> str:
        role, target = match["role"], match["target"].strip()
        if role not in ROLES:
            raise ValueError(f"{obj.path}: unknown docstring role :{role}: (known: {', '.join(ROLES)})")
        short = target.startswith("~")
        target = target.lstrip("~")
        found = _resolve(target, obj, pkg)
        display = (found or target).lstrip(".").split(".")[-1] if short else target.lstrip(".")
        if role in ("func", "meth"):
            display += "()"
        if found is None:
            return f"`{display}`"
        return f'<autoref identifier="{html.escape(found)}" optional><code>{html.escape(display)}</code></autoref>'

    return ROLE.sub(replace, text)


def _resolve(target: str, obj: Any, pkg: griffe.Module) -> str | None:
    """The full path of ``target`` as seen from ``obj``'s docstring, or None when the package has no such object."""
    module = obj if obj.is_module else obj.module
    candidates = []
    if target.startswith("."):
        dots = len(target) - len(target.lstrip("."))
        rest = target[dots:]
        base = module.path if module.is_package else module.path.rpartition(".")[0]
        for _ in range(dots - 1):
            base = base.rpartition(".")[0]
        candidates += [f"{base}.{rest}", f"{module.path}.{rest}", f"{obj.path}.{rest}"]
        if obj.parent is not None:
            candidates.append(f"{obj.parent.path}.{rest}")
    else:
        candidates += [target, f"{module.path}.{target}", f"{pkg.path}.{target}"]
    for path in candidates:
        if path.split(".")[0] == pkg.path and _exists(path, pkg):
            return path
    return None


def _exists(path: str, pkg: griffe.Module) -> bool:
    inner = path[len(pkg.path) + 1 :]
    if not inner:
        return True
    try:
        pkg[inner]
    except (KeyError, griffe.AliasResolutionError, griffe.CyclicAliasError, ValueError):
        return False
    return True


def _examples(text: str) -> str:
    """Loose ``>>>`` example lines (and the output lines after them) fenced as Python console code; an Examples
    section (which the Google parser renders itself) and fenced blocks are left alone."""
    lines, out, i = text.split("\n"), [], 0
    fenced = section = False
    while i < len(lines):
        line = lines[i]
        stripped = line.strip()
        if stripped.startswith("```"):
            fenced = not fenced
        if re.match(r"^(Examples?|Example):\s*$", stripped):
            section = True
        elif stripped and not line.startswith((" ", "\t")) and section and not stripped.startswith(">>>"):
            section = False
        match = PROMPT.match(line)
        if match and not fenced and not section:
            indent = match["indent"]
            block = []
            while i < len(lines) and lines[i].strip() and lines[i].startswith(indent):
                block.append(lines[i][len(indent) :])
                i += 1
            out += [f"{indent}```pycon", *(f"{indent}{b}" for b in block), f"{indent}```"]
            continue
        out.append(line)
        i += 1
    return "\n".join(out)
