"""Keeps bytes a grammar accepts but the text must not hold out of the mask.

xgrammar matches UTF-8 by code point ranges that include the surrogates
U+D800..U+DFFF, so ``ED A0..BF xx`` (a "UTF-8-encoded lone surrogate") passes
inside a JSON string or a regex ``.``. That is not valid UTF-8: the detokenizer
turns it into U+FFFD, and the text no longer is what the grammar checked. For
JSON, raw control characters (U+0000..U+001F) are invalid inside strings; the
xgrammar version pinned here already excludes them from its string rule, and
compact JSON needs none between values, so JSON constraints forbid every token
holding such a byte as a second line of defence.

The guard is a mask ANDed onto the grammar's own: tokens containing ``ED A0..BF``
are always removed; after a token that ends in ``ED``, tokens starting with
``A0..BF`` are removed too (the surrogate would span the two tokens). A
grammar never dead-ends on it: after ``ED`` the continuation bytes ``80..9F``
(U+D000..U+D7FF) stay allowed.
"""

from __future__ import annotations

import re

import numpy as np
import torch

from modserve.api import GrammarVocab
from modserve.plugins.grammars.bits import pack

_SURROGATE = re.compile(rb"\xed[\xa0-\xbf]")
_CONTROL = re.compile(rb"[\x00-\x1f]")


class ByteGuard:
    """The two masks of one vocabulary, for text (``json=False``) or JSON constraints."""

    def __init__(self, vocab: GrammarVocab, json: bool) -> None:
        V = vocab.vocab_size
        base = np.ones(V, dtype=bool)  # special tokens and EOS (bytes None) stay as the grammar says
        after_ed = np.ones(V, dtype=bool)
        self.ends_with_ed = np.zeros(V, dtype=bool)
        for i, b in enumerate(vocab.token_bytes):
            if not b:
                continue
            if _SURROGATE.search(b) or (json and _CONTROL.search(b)):
                base[i] = False
            if 0xA0 <= b[0] <= 0xBF:
                after_ed[i] = False
            self.ends_with_ed[i] = b[-1] == 0xED
        self.mask = pack(base)  # [W] int32
        self.mask_after_ed = pack(base & after_ed)  # [W] int32

    def restrict(self, row: torch.Tensor, after_ed: bool) -> None:
        """AND one bitmask row with the guard; ``after_ed``: the text so far ends in byte ED."""
        row.bitwise_and_(self.mask_after_ed if after_ed else self.mask)
