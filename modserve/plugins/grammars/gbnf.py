"""llama.cpp's GBNF, made readable by xgrammar's EBNF parser.

The one gap that matters in practice: GBNF allows an empty alternative
(``ws ::= | " "``, as llama.cpp's own json.gbnf writes it); xgrammar wants the
empty string spelled out (``ws ::= "" | " "``). Same language either way.
"""

from __future__ import annotations


def fill_empty_alternatives(ebnf: str) -> str:
    """Insert ``""`` wherever an alternative is empty: after ``::=``, ``|`` or ``(``
    and before ``|`` or ``)``. String literals, character classes and comments are
    copied untouched."""
    out: list[str] = []
    i, n = 0, len(ebnf)
    empty = False  # nothing yet since the last '::=', '|' or '('
    while i < n:
        c = ebnf[i]
        if c in '"[':
            close = '"' if c == '"' else "]"
            j = i + 1
            while j < n and ebnf[j] != close:
                j += 2 if ebnf[j] == "\\" else 1
            out.append(ebnf[i: j + 1])
            i, empty = j + 1, False
            continue
        if c == "#":
            j = ebnf.find("\n", i)
            j = n if j < 0 else j
            out.append(ebnf[i:j])
            i = j
            continue
        if ebnf.startswith("::=", i):
            out.append("::=")
            i, empty = i + 3, True
            continue
        if c in "|)" and empty:
            out.append('"" ')
        if c in "|(":
            empty = True
        elif not c.isspace():
            empty = False
        out.append(c)
        i += 1
    return "".join(out)
