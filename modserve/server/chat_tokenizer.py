"""Chat prompts from untrusted messages: special-token text in content stays text.

A user who writes ``<|im_end|>`` in a message must not be able to close their turn and
forge a system turn. The template's own control tokens stay control tokens; only the
pieces of the rendered text that came from content are encoded with special tokens off.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import AddedToken
from tokenizers import Tokenizer as RustTokenizer

from modserve.engine.tokenizer import Tokenizer

# Private-use characters: no tokenizer vocabulary or chat template gives them a meaning.
_PLACEHOLDER = "\ue000{}\ue001"
_PLACEHOLDER_RE = re.compile("\ue000([0-9]+)\ue001")
_MARK = "\ue002modserve-split\ue003"


@dataclass(slots=True)
class TemplateInputs:
    """What a request hands the chat template beside its messages, as transformers'
    ``apply_chat_template(messages, tools=, documents=, chat_template=, **kwargs)`` takes it."""

    tools: list[dict[str, Any]] | None = None
    documents: list[dict[str, str]] | None = None
    chat_template: str | None = None  # the request's own, instead of the tokenizer's
    continue_final_message: bool = False
    kwargs: dict[str, Any] = field(default_factory=dict)  # chat_template_kwargs, reasoning_effort


class ChatTokenizer(Tokenizer):
    """A :class:`Tokenizer` with ``encode_chat``; its private backend copy is never mutated
    after ``__init__``, so ``encode_chat`` is safe to share between threads."""

    def __init__(self, path: str | Path, model_dir: str | Path | None = None,
                 chat_template: str | None = None) -> None:
        super().__init__(path, model_dir, chat_template)
        self.special_ids = frozenset(i for i, t in self.hf.added_tokens_decoder.items() if t.special)
        self._strips = {i: (t.lstrip, t.rstrip) for i, t in self.hf.added_tokens_decoder.items()
                        if t.special and (t.lstrip or t.rstrip)}
        # A copy that encodes special-token text as ordinary text (transformers'
        # split_special_tokens), set up once so no thread ever toggles it.
        self._split = RustTokenizer.from_str(self.backend.to_str())
        self._split.no_truncation()
        self._split.no_padding()
        self._split.encode_special_tokens = True
        # A non-special added token (still a split point with encode_special_tokens on):
        # "MARK + piece" encodes piece as text that follows a special token, which is not
        # always how piece encodes alone (Metaspace prepend_scheme="first" prefixes "▁").
        self._split.add_tokens([AddedToken(_MARK, normalized=False, special=False)])
        self._mark_id = self._split.token_to_id(_MARK)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            inputs: TemplateInputs | None = None) -> str:
        inputs = inputs or TemplateInputs()
        if not (inputs.chat_template or self.hf.chat_template):
            raise ValueError("this tokenizer has no chat template; use completions with a plain prompt")
        try:
            return self.hf.apply_chat_template(
                messages, tools=inputs.tools, documents=inputs.documents, chat_template=inputs.chat_template,
                add_generation_prompt=add_generation_prompt, continue_final_message=inputs.continue_final_message,
                tokenize=False, **inputs.kwargs)
        except Exception as e:  # the template is the request's (or fails on its messages): say why
            raise ValueError(f"the chat template failed on these messages: {type(e).__name__}: {e}") from None

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    special_tokens_in_content: bool = False, inputs: TemplateInputs | None = None) -> list[int]:
        """Prompt ids for a conversation, rendered by the chat template.

        Special tokens the template writes are control tokens; special-token text inside
        message strings (every string field but ``role``, which callers must validate) is
        encoded as ordinary text, so a user cannot forge a turn. Contents without
        special-token text give exactly ``encode(apply_chat_template(...), False)``, as
        does ``special_tokens_in_content=True`` for any contents. Raises ValueError when
        there is no chat template, or when the template rewrites content in a way that
        hides where it lies and some content holds special-token text.
        """
        text = self.apply_chat_template(messages, add_generation_prompt, inputs)
        if special_tokens_in_content:
            return self.encode(text, add_special_tokens=False)
        # NOTE: strings deeper than a message's own fields (tools, tool calls, documents, template
        # kwargs) are rendered as the template likes, so they are not mapped: refuse forged tokens there.
        for value in _nested_strings(messages, inputs):
            if self.special_ids.intersection(self.encode(value, add_special_tokens=False)):
                raise ValueError("tools, tool calls, documents or chat_template_kwargs hold special-token text")
        enc = self.hf(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = list(enc["input_ids"]), list(enc["offset_mapping"])
        spans = self._content_spans(messages, add_generation_prompt, text, inputs)
        if spans is None:
            # Fallback: the template rewrote content beyond a strip(), so we can't tell its
            # special tokens from the template's. Contents free of special-token text are
            # safe as rendered; otherwise refuse rather than guess.
            for value in _strings(messages):
                if self.special_ids.intersection(self.encode(value, add_special_tokens=False)):
                    raise ValueError("message content holds special-token text and this chat template "
                                     "rewrites content, so it can't be encoded safely")
            return ids
        forged = [self._overlaps(i, o, text, spans) for i, o in zip(ids, offsets)]
        if not any(forged):
            return ids  # the common case: identical to the plain encoding
        # Template-owned special tokens split the text into pieces that HF encodes
        # independently; only pieces holding forged tokens are re-encoded as text.
        out: list[int] = []
        run: list[int] = []  # token indices since the last template-owned special token
        start = 0  # where the current piece starts in text
        for k, (i, (s, e)) in enumerate(zip(ids, offsets)):
            if i in self.special_ids and not forged[k]:
                out += self._piece(text[start:s], start) if any(forged[j] for j in run) else [ids[j] for j in run]
                out.append(i)
                run, start = [], e  # e covers any whitespace an lstrip/rstrip token ate
            else:
                run.append(k)
        out += self._piece(text[start:], start) if any(forged[j] for j in run) else [ids[j] for j in run]
        return out

    def _overlaps(self, token_id: int, offset: tuple[int, int], text: str, spans: list[tuple[int, int]]) -> bool:
        """Whether special token ``token_id`` at ``offset`` came (even in part) from content."""
        if token_id not in self.special_ids:
            return False
        s, e = offset
        lstrip, rstrip = self._strips.get(token_id, (False, False))
        # An lstrip/rstrip token's offsets include the whitespace it ate, which may be
        # content's; only the token's own text decides who wrote it.
        if lstrip:
            s = e - len(text[s:e].lstrip())
        if rstrip:
            e = s + len(text[s:e].rstrip())
        return any(s < b and a < e for a, b in spans)

    def _piece(self, piece: str, start: int) -> list[int]:
        """``piece`` encoded with special-token text as text, as if it sat at ``start``."""
        if not piece:
            return []
        if _MARK in piece:  # it would encode as the marker's id, which the model doesn't have
            raise ValueError("message content holds reserved private-use characters")
        if start == 0:
            return self._split.encode(piece, add_special_tokens=False).ids
        marked = self._split.encode(_MARK + piece, add_special_tokens=False).ids
        assert marked[0] == self._mark_id, "the split marker must encode as its own token"
        return marked[1:]

    def _content_spans(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                       text: str, inputs: TemplateInputs | None = None) -> list[tuple[int, int]] | None:
        """Where each message string lies in ``text``, the rendered conversation.

        Renders once more with every string replaced by a numbered placeholder, then
        matches ``text`` against the literal pieces between placeholders. Content may have
        been strip()ped (jinja's ``trim``, as Llama 3 templates do). None if the template
        treats content any other way (or fails on placeholders).
        """
        values: list[str] = []

        def hole(v: str) -> str:
            values.append(v)
            return _PLACEHOLDER.format(len(values) - 1)

        holed = [{k: hole(v) if isinstance(v, str) and k != "role" else v for k, v in m.items()} for m in messages]
        try:
            parts = _PLACEHOLDER_RE.split(self.apply_chat_template(holed, add_generation_prompt, inputs))
        except Exception:  # a template may reject a placeholder: then we can't map
            return None
        spans, pos = [], 0
        for n in range(0, len(parts) - 1, 2):
            literal, index, following = parts[n], int(parts[n + 1]), parts[n + 2]
            if index >= len(values) or not text.startswith(literal, pos):
                return None
            value = values[index]
            pos += len(literal)
            for v in (value, value.strip()):
                if text.startswith(v, pos) and text.startswith(following, pos + len(v)):
                    spans.append((pos, pos + len(v)))
                    pos += len(v)
                    break
            else:
                return None
        return spans if text[pos:] == parts[-1] else None


def _strings(messages: list[dict[str, Any]]) -> list[str]:
    return [v for m in messages for k, v in m.items() if isinstance(v, str) and k != "role"]


def _nested_strings(messages: list[dict[str, Any]], inputs: TemplateInputs | None) -> list[str]:
    """Every string (keys too) not a message's own field: ``_content_spans`` does not map these."""
    def walk(value: Any) -> list[str]:
        if isinstance(value, str):
            return [value]
        if isinstance(value, dict):
            return [s for k, v in value.items() for s in walk(k) + walk(v)]
        return [s for v in value for s in walk(v)] if isinstance(value, (list, tuple)) else []

    found = [s for m in messages for v in m.values() if not isinstance(v, str) for s in walk(v)]
    if inputs is not None:
        found += walk([inputs.tools or [], inputs.documents or [], inputs.kwargs])
    return found
