"""How large the automaton of a regex or grammar text is, measured on the text alone.

Linear in the text, no recursion (a 5,000-deep nesting is counted, never descended),
and dialect-blind: escapes, character classes, groups, ``|`` and quantifiers are read
the same in Python, ECMAScript, Rust and xgrammar regexes; GBNF and Lark grammars add
string literals, rules and Lark's ``~ n`` and ``/regex/`` terminals. The server
refuses specs over its bounds with these measures; outlines-core refuses what its
DFA construction cannot do quickly.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# Counts above this are all "too many": Python's ints would otherwise grow without end
# when a hostile spec nests huge counts.
SATURATE = 10**15
# A character class (or ".", "\\d", "\\w") counts as this many positions: each of its
# DFA states takes every token that can start with one of its characters.
CLASS_POSITIONS = 8


@dataclass(slots=True)
class Shape:
    """What a spec expands to, and where its largest part is.

    ``size``: positions of the expanded automaton (counted repetitions multiplied out,
    branches summed); ``repetition``: the largest count, nested counts multiplied
    (``(a{100}){100}`` is 10,000); ``depth``: group nesting; ``alternatives``: the most
    branches of one group; ``variable_count``: the largest count over a part whose width
    varies (``(a|bc){20}``), whose DFA can grow exponentially with the count.
    """

    size: int = 0
    repetition: int = 1
    depth: int = 0
    alternatives: int = 0
    variable_count: int = 0
    where: dict[str, str] | None = None  # measure -> where in the spec it peaked

    def note(self, measure: str, value: int, where: str = "") -> None:
        if value > getattr(self, measure):
            setattr(self, measure, min(value, SATURATE))
            if where:
                self.where = {**(self.where or {}), measure: where}


def json_depth(text: str) -> int:
    """How deep ``text``'s JSON objects and arrays nest, without parsing it."""
    depth = deepest = 0
    for c in _BRACKET.findall(_STRING.sub("", text)):  # strings out first: brackets in them do not count
        if c in "[{":
            depth += 1
            deepest = max(deepest, depth)
        else:
            depth -= 1
    return deepest


_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')
_BRACKET = re.compile(r"[\[\]{}]")


# -- regex and grammar text ------------------------------------------------------------------
@dataclass(slots=True)
class _Group:
    """One open group of a regex or grammar rule, as it is scanned: its size and the
    width (characters, min and max) of the branch being read and of those before it."""

    size: int = 0
    repetition: int = 1  # the largest product of counts inside it
    branches: int = 1
    width: tuple[int, int] = (0, 0)
    done: tuple[int, int] | None = None  # the branches before this one, together
    last: tuple[int, int, int, int] = (0, 1, 0, 0)  # the last atom, which a quantifier repeats: size, rep, width

    def atom(self, size: int = 1, repetition: int = 1, width: tuple[int, int] = (1, 1)) -> None:
        self.size = _sat(self.size + size)
        self.width = (_sat(self.width[0] + width[0]), _sat(self.width[1] + width[1]))
        self.last = (size, repetition, *width)
        self.repetition = max(self.repetition, repetition)

    def quantify(self, low: int, high: int) -> None:
        """Repeat the last atom ``low`` to ``high`` times (SATURATE: no upper bound)."""
        size, rep, wmin, wmax = self.last
        copies = max(1, high if high < SATURATE else low)
        self.size = _sat(self.size + size * (copies - 1))
        lo, hi = wmin * low, (SATURATE if high >= SATURATE and wmax else wmax * high)
        self.width = (_sat(self.width[0] - wmin + lo), _sat(self.width[1] - wmax + hi))
        self.last = (_sat(size * copies), _sat(rep * copies), lo, _sat(hi))
        if high > 1 and high < SATURATE or low > 1:
            self.repetition = max(self.repetition, self.last[1])

    def branch(self) -> None:
        w = self.width if self.done is None else (min(self.done[0], self.width[0]), max(self.done[1], self.width[1]))
        self.branches, self.done, self.width, self.last = self.branches + 1, w, (0, 0), (0, 1, 0, 0)

    def total_width(self) -> tuple[int, int]:
        if self.done is None:
            return self.width
        return min(self.done[0], self.width[0]), max(self.done[1], self.width[1])


def _sat(n: int) -> int:
    return min(max(n, 0), SATURATE)


class _Scanner:
    """Groups, atoms, branches and counted repetitions of a regex or grammar text."""

    def __init__(self) -> None:
        self.groups = [_Group()]
        self.shape = Shape()

    def open(self) -> None:
        self.groups.append(_Group())
        self.shape.note("depth", len(self.groups) - 1)

    def close(self) -> None:
        if len(self.groups) > 1:
            inner = self.groups.pop()
            self.groups[-1].atom(inner.size, inner.repetition, inner.total_width())

    def branch(self) -> None:
        self.groups[-1].branch()
        self.shape.note("alternatives", self.groups[-1].branches)

    def structure(self, c: str) -> bool:
        """``(``, ``)`` or ``|``, alike in regexes and grammars: opened, closed or branched;
        False for any other character."""
        step = {"(": self.open, ")": self.close, "|": self.branch}.get(c)
        if step is not None:
            step()
        return step is not None

    def count(self, low: int, high: int) -> None:
        group = self.groups[-1]
        if group.last[2] != group.last[3]:  # a part of varying width, counted
            self.shape.note("variable_count", min(high, max(low, 1) if high >= SATURATE else high))
        group.quantify(low, high)

    def loop(self, quantifier: str) -> None:
        """``*``, ``+`` or ``?``: a loop adds no positions, only width."""
        self.groups[-1].quantify(0 if quantifier in "*?" else 1, 1 if quantifier == "?" else SATURATE)

    def end(self) -> Shape:
        while len(self.groups) > 1:
            self.close()
        top = self.groups[0]
        self.shape.note("size", self.shape.size + top.size)
        self.shape.note("repetition", top.repetition)
        self.groups = [_Group()]
        return self.shape


# {n}, {n,}, {n,m}, {,m}: a count; "{" followed by anything else is a literal brace.
_COUNT = re.compile(r"\{\s*(\d*)\s*(,)?\s*(\d*)\s*\}")


def _counted(text: str, i: int) -> tuple[int, int, int] | None:
    """(low, high, end) of a counted repetition at ``text[i]`` (high SATURATE: none), or None."""
    m = _COUNT.match(text, i)
    if m is None or not (m.group(1) or m.group(3)):
        return None
    low = _number(m.group(1) or "0")
    high = low if not m.group(2) else _number(m.group(3)) if m.group(3) else SATURATE
    return low, high, m.end()


def _number(digits: str) -> int:
    # Past 15 digits it is "too many" anyway; int() of 5,000 digits would raise.
    return SATURATE if len(digits) > 15 else min(int(digits), SATURATE)


def _class_end(text: str, i: int) -> int:
    """The index after the character class opening at ``text[i] == "["``."""
    j = i + 1
    if text[j: j + 1] == "^":
        j += 1
    if text[j: j + 1] == "]":  # a leading "]" is literal
        j += 1
    while j < len(text) and text[j] != "]":
        j += 2 if text[j] == "\\" else 1
    return j + 1


def regex_shape(regex: str) -> Shape:
    scan = _Scanner()
    i, n = 0, len(regex)
    while i < n:
        c = regex[i]
        group = scan.groups[-1]
        if c == "\\":
            group.atom(CLASS_POSITIONS if regex[i + 1: i + 2].isalpha() else 1)
            i += 2
            continue
        if c == "[":
            group.atom(CLASS_POSITIONS)
            i = _class_end(regex, i)
            continue
        if c == "{" and (counted := _counted(regex, i)):
            scan.count(*counted[:2])
            i = counted[2]
            continue
        if scan.structure(c):
            pass
        elif c in "*+?":
            if regex[i - 1: i] not in ("(", "*", "+", "?", "}"):  # not "(?:" nor a lazy "+?"
                scan.loop(c)
        else:
            group.atom(CLASS_POSITIONS if c == "." else 1)
        i += 1
    return scan.end()


# A Lark repetition: "x" ~ 3 or "x" ~ 2..5.
_LARK_COUNT = re.compile(r"~\s*(\d+)(?:\s*\.\.\s*(\d+))?")
# A rule's start: GBNF "name ::=", Lark "name:" / "?name:" / "NAME.2:".
_RULE_START = re.compile(r"\n\s*[?!]?[A-Za-z_][\w-]*(?:\.\d+)?\s*(?:::=|:)")


def grammar_shape(grammar: str) -> Shape:
    """An EBNF/GBNF or Lark grammar: each rule scanned as a regex is, with string literals,
    character classes and Lark's /regex/ terminals as atoms; rules add up (a rule used
    twice is not counted twice: backends compile it once)."""
    scan = _Scanner()
    text = "\n" + grammar
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        group = scan.groups[-1]
        if c == "\n":
            start = _RULE_START.match(text, i)
            if start:
                scan.end()  # a new rule: counts do not carry across rules
                i = start.end()
                continue
            i += 1
            continue
        if c in "\"'":
            j = i + 1
            while j < n and text[j] != c:
                j += 2 if text[j] == "\\" else 1
            group.atom(max(1, j - i - 1), 1, (j - i - 1, j - i - 1))
            i = j + 1
            continue
        if c == "/" and text[i + 1: i + 2] == "/" or c == "#":
            end = text.find("\n", i)
            i = n if end < 0 else end
            continue
        if c == "/":  # a Lark regex terminal
            j = i + 1
            while j < n and text[j] not in "/\n":
                j += 2 if text[j] == "\\" else 1
            inner = regex_shape(text[i + 1: j])
            group.atom(inner.size, inner.repetition, (0, SATURATE))
            scan.shape.note("alternatives", inner.alternatives, "")
            scan.shape.note("depth", inner.depth + len(scan.groups) - 1, "")
            i = j + 1
            continue
        if c == "[":
            group.atom()
            i = _class_end(text, i)
            continue
        if c == "{" and (counted := _counted(text, i)):
            scan.count(*counted[:2])
            i = counted[2]
            continue
        if c == "~" and (m := _LARK_COUNT.match(text, i)):
            low = _number(m.group(1))
            scan.count(low, _number(m.group(2)) if m.group(2) else low)
            i = m.end()
            continue
        if scan.structure(c):
            pass
        elif c.isalnum() or c == "_":
            j = i
            while j < n and (text[j].isalnum() or text[j] in "_-."):
                j += 1
            group.atom(1, 1, (0, SATURATE))  # a rule reference: one position, any width
            i = j
            continue
        i += 1
    return scan.end()
