"""The bytes each token adds to the text: what a grammar matches against.

Grammar backends work on bytes, not on token strings: a byte-level BPE token
spells its bytes with printable stand-in characters (``Ġ`` for a space), a
SentencePiece token uses ``▁`` and ``<0x0A>``. Decoding one token at a time with
``tokenizer.decode`` is lossy (half a UTF-8 character decodes to U+FFFD), so the
token strings are mapped back to bytes here, once per tokenizer.
"""

from __future__ import annotations

import json
import re
from typing import Any

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-to-character table, inverted: stand-in character -> byte.

    Printable bytes stand for themselves; the other 68 are shifted to code points
    256 and up, in byte order.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {chr(b): b for b in printable}
    shifted = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + shifted)] = b
            shifted += 1
    return table


def token_bytes(hf_tokenizer: Any, vocab_size: int) -> list[bytes | None]:
    """For every id below ``vocab_size``: the token's bytes, or None for special
    tokens and ids the tokenizer does not have (a grammar never allows those)."""
    backend = hf_tokenizer.backend_tokenizer
    decoder = json.dumps(json.loads(backend.to_str()).get("decoder") or {})
    special = set(hf_tokenizer.all_special_ids)
    special.update(i for i, t in hf_tokenizer.added_tokens_decoder.items() if t.special)
    pieces = hf_tokenizer.convert_ids_to_tokens(list(range(min(len(hf_tokenizer), vocab_size))))
    if '"ByteLevel"' in decoder:
        alphabet = byte_level_alphabet()
        to_bytes = lambda s: bytes(alphabet[c] for c in s) if all(c in alphabet for c in s) else s.encode()
    elif '"ByteFallback"' in decoder or "\u2581" in decoder:
        to_bytes = _sentencepiece_bytes
    else:  # e.g. WordPiece: no byte view; the token's own text is the best available
        to_bytes = lambda s: s.encode()
    out: list[bytes | None] = [None] * vocab_size
    for i, piece in enumerate(pieces):
        if piece is not None and i not in special:
            out[i] = to_bytes(piece)
    return out


def _sentencepiece_bytes(piece: str) -> bytes:
    m = _BYTE_TOKEN.fullmatch(piece)
    if m:
        return bytes([int(m.group(1), 16)])
    return piece.replace("\u2581", " ").encode()
