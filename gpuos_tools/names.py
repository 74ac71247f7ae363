"""Kernel names short enough for a table row, and still told apart.

A demangled C++ kernel name can run to thousands of characters (PyTorch's random-number kernels
repeat their lambda types a dozen times), and cutting it at a fixed width makes rows that differ
only at the end look identical. ``short_names`` abbreviates each name as far as it stays
distinct from the others in the same table:

1. a name that fits is shown as it is; else the return type (``void``) and the parameter
   list go;
2. if that is still too long, template arguments deeper than a few levels are shown as
   ``<…>``, parenthesised parts (lambdas' enclosing functions) as ``(…)``, and names inside
   template arguments lose their namespaces (``at::native::FillFunctor<float>`` becomes
   ``FillFunctor<…>``), one level less at a time until it fits;
3. names that would then look alike get their detail back, one level at a time;
4. what is still too long is cut in the middle, keeping its start and its end, where names
   of one family differ; names alike even then are numbered.

JSON output always carries the full names; this is only for people.
"""

from __future__ import annotations

from collections.abc import Sequence

ELLIPSIS = "…"
_OPEN = {"<": ">", "(": ")", "[": "]", "{": "}"}


def _strip_signature(name: str) -> str:
    """``void ns::k<T>(int, float*)`` -> ``ns::k<T>``: no return type, no parameter list."""
    text = name.strip()
    # the parameter list: the last top-level (...) that ends the name
    if text.endswith(")"):
        depth = 0
        for i in range(len(text) - 1, -1, -1):
            c = text[i]
            if c in ")>]}":
                depth += 1
            elif c in "(<[{":
                depth -= 1
                if depth == 0:
                    if c == "(" and i > 0:
                        text = text[:i]
                    break
    # the return type: a top-level space before the qualified name (operator names aside)
    depth = 0
    cut = -1
    for i, c in enumerate(text):
        if c in "<([{":
            depth += 1
        elif c in ">)]}":
            depth -= 1
        elif c == " " and depth == 0 and not text[:i].endswith(("operator", "anonymous")):
            cut = i
    if cut >= 0 and not text[cut + 1 :].startswith("namespace)"):
        text = text[cut + 1 :]
    return text.strip()


def _unqualified(part: str) -> str:
    """``at::native::FillFunctor`` -> ``FillFunctor``; keeps everything after a top-level ``::``."""
    depth = 0
    start = 0
    i = 0
    while i < len(part):
        c = part[i]
        if c in "<([{":
            depth += 1
        elif c in ">)]}":
            depth -= 1
        elif c == ":" and depth == 0 and part.startswith("::", i):
            start = i + 2
            i += 1
        i += 1
    return part[start:]


def abbreviate(name: str, depth: int) -> str:
    """``name`` without its signature, template arguments kept to ``depth`` levels (names inside
    them unqualified), anonymous namespaces dropped and parenthesised parts elided; ``depth``
    < 0 keeps everything."""
    text = _strip_signature(name)
    if depth < 0:
        return text
    text = text.replace("(anonymous namespace)::", "")
    out: list[str] = []
    level = 0
    token = ""  # the identifier being written at the current level, to unqualify
    i = 0
    while i < len(text):
        c = text[i]
        if c in _OPEN:
            if c == "(" or level >= depth:
                # skip the whole bracketed group
                close, nest, j = _OPEN[c], 0, i
                while j < len(text):
                    if text[j] in "<([{":
                        nest += 1
                    elif text[j] in ">)]}":
                        nest -= 1
                        if nest == 0:
                            break
                    j += 1
                out.append(token + c + ELLIPSIS + close)
                token = ""
                i = j + 1
                continue
            out.append(token + c)
            token = ""
            level += 1
        elif c in ">)]}":
            out.append(token + c)
            token = ""
            level -= 1
        elif c in ", ":
            out.append(token + c)
            token = ""
        else:
            token += c
            if level > 0 and token.endswith("::"):
                token = ""  # namespaces inside template arguments go
        i += 1
    out.append(token)
    return "".join(out).replace(", ", ",").replace(",", ", ").replace("> >", ">>")


def _clip(text: str, width: int) -> str:
    """At most ``width`` characters: the start and the end kept, the middle elided."""
    if len(text) <= width:
        return text
    if width <= 1:
        return text[:width]
    head = (width - 1) * 2 // 3
    tail = width - 1 - head
    return text[:head] + ELLIPSIS + (text[-tail:] if tail else "")


def short_names(names: Sequence[str], width: int = 80) -> list[str]:
    """Each name at the most detail that fits ``width`` characters, with more detail (cut in the
    middle if need be) where two names would otherwise look alike; equal names stay equal."""
    distinct = list(dict.fromkeys(names))
    levels = (-1, 3, 2, 1, 0)  # most detail first, after the name as it is
    forms = {n: [" ".join(n.split()), *(abbreviate(n, d) for d in levels)] for n in distinct}
    at = {n: next((i for i, f in enumerate(forms[n]) if len(f) <= width), len(levels)) for n in distinct}

    def shown(n: str) -> str:
        return _clip(forms[n][at[n]], width)

    while True:
        groups: dict[str, list[str]] = {}
        for n in distinct:
            groups.setdefault(shown(n), []).append(n)
        alike = [g for g in groups.values() if len(g) > 1]
        movable = [n for g in alike for n in g if at[n] > 0]
        if not movable:
            break
        for n in movable:
            at[n] -= 1
    chosen = {n: shown(n) for n in distinct}
    for group in alike:  # alike even in full, within the width: numbered
        for k, n in enumerate(group, 1):
            chosen[n] = _clip(chosen[n], width - len(f" #{k}")) + f" #{k}"
    return [chosen[n] for n in names]


def short_name(name: str, width: int = 80) -> str:
    """One name on its own, at the most detail that fits ``width``."""
    return short_names([name], width)[0]
