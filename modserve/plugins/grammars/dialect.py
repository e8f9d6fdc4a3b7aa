r"""Where a backend reads a spec differently from what users mean, rewritten to mean that.

- GBNF allows an empty alternative (``ws ::= | " "``, as llama.cpp's own json.gbnf
  writes it); xgrammar's parser wants the empty string spelled out (``ws ::= "" | " "``).
- A regex ``.`` in xgrammar matches any character, newline included; in Python,
  Rust (outlines-core) and ECMAScript it does not. It becomes ``[^\n]``.
- xgrammar reads ``\\A`` and ``\\Z`` as the letters A and Z and drops ``^`` and ``$``
  wherever they stand (``a$b`` matches ``ab``). A regex is matched against the whole
  output, so ``^`` first and ``$`` last mean nothing; elsewhere, and ``\\A``, ``\\Z``,
  ``\\z``, ``\\b``, ``\\B``, ``\\G``, they are refused (see ``anchor``).
- outlines-core's Rust regex reads ``\d`` and ``\w`` as Unicode classes (``٨`` is a
  digit); JSON Schema patterns are ECMAScript, where they are ASCII, as in xgrammar.
  They become ``[0-9]`` and ``[0-9A-Za-z_]``.
"""

from __future__ import annotations

from typing import Iterator


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


def _regex_pieces(regex: str) -> Iterator[tuple[str, bool]]:
    """The regex as escapes (``\\x``) and single characters, each with whether it stands
    inside a character class. A class's opening ``[`` comes with its leading literal ``]``
    (``[]``, ``[^]``), which does not close it."""
    i, n = 0, len(regex)
    in_class = False
    while i < n:
        c = regex[i]
        if c == "\\":
            yield regex[i: i + 2], in_class
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            j = i + 1 + (regex[i + 1: i + 2] == "^")
            end = j + 1 if regex[j: j + 1] == "]" else i + 1
            yield regex[i:end], False
            in_class, i = True, end
            continue
        yield c, in_class
        i += 1


_ANCHOR_ESCAPES = ("\\A", "\\Z", "\\z", "\\b", "\\B", "\\G")


def anchor(regex: str) -> str | None:
    """The first anchor of ``regex`` that a backend matching the whole output would misread:
    any ``\\A``, ``\\Z``, ``\\b`` ..., a ``^`` after the first character, a ``$`` before
    the last (outside character classes; ``^(a|b)$`` is fine). None if there is none."""
    pieces = list(_regex_pieces(regex))
    for i, (piece, inside) in enumerate(pieces):
        if inside:
            continue
        if piece in _ANCHOR_ESCAPES:
            return piece
        if (piece == "^" and i > 0) or (piece == "$" and i < len(pieces) - 1):
            return piece
    return None


_COMPLEMENTS = (("\\s", "\\S"), ("\\d", "\\D"), ("\\w", "\\W"))


def empty_class(regex: str) -> str | None:
    """The first negated character class of ``regex`` that excludes every character
    (``[^\\s\\S]``: a class and its complement), which no text can match; None if none."""
    members: list[str] | None = None  # the pieces of the class being read
    for piece, inside in _regex_pieces(regex):
        if members is not None and not inside:  # its closing "]"
            negated = members[:1] == ["^"]
            if negated and any(a in members and b in members for a, b in _COMPLEMENTS):
                return "[" + "".join(members) + "]"
            members = None
        elif members is not None:
            members.append(piece)
        if not inside and piece.startswith("["):
            members = ["^"] if piece.startswith("[^") else []
    return None


def dot_excludes_newline(regex: str) -> str:
    """Every unescaped ``.`` outside a character class becomes ``[^\\n]``."""
    return "".join("[^\\n]" if piece == "." and not inside else piece for piece, inside in _regex_pieces(regex))


_ASCII = {"\\d": "0-9", "\\w": "0-9A-Za-z_"}


def ascii_classes(regex: str) -> str:
    """``\\d`` and ``\\w`` as their ASCII ranges, inside character classes or out."""
    out = []
    for piece, inside in _regex_pieces(regex):
        ranges = _ASCII.get(piece)
        out.append(piece if ranges is None else ranges if inside else f"[{ranges}]")
    return "".join(out)
