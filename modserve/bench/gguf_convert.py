"""Run llama.cpp's ``convert_hf_to_gguf.py`` on a modserve checkpoint (run by path, no modserve import).

    python gguf_convert.py CONVERTER MODEL_DIR --outtype bf16 --outfile OUT.gguf

The converter names a BPE tokenizer's pre-tokenizer by hashing how it splits a fixed text,
against a table of published models; a tokenizer trained for a checkpoint of our own is in no
table, so the converter refuses it. When ``tokenizer.json`` says its pre-tokenizer is GPT-2's
(``ByteLevel`` with GPT-2's regex), it is named ``gpt-2``, which is what it is; anything else is
still refused. The rest is the converter itself, unchanged.
"""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path


def is_gpt2_byte_level(model_dir: Path) -> bool:
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        return False
    pre = json.loads(path.read_text()).get("pre_tokenizer") or {}
    return pre.get("type") == "ByteLevel" and pre.get("use_regex", True)


def main() -> None:
    converter, model_dir = Path(sys.argv[1]), Path(sys.argv[2])
    sys.path.insert(0, str(converter.parent / "gguf-py"))
    sys.path.insert(0, str(converter.parent))
    from conversion.base import TextModel

    detect = TextModel.get_vocab_base_pre

    def vocab_base_pre(self, tokenizer) -> str:
        try:
            return detect(self, tokenizer)
        except NotImplementedError:
            if not is_gpt2_byte_level(model_dir):
                raise
            print("gguf_convert: pre-tokenizer not in the converter's table; tokenizer.json's is GPT-2's "
                  "ByteLevel split, so it is written as 'gpt-2'", file=sys.stderr)
            return "gpt-2"

    TextModel.get_vocab_base_pre = vocab_base_pre
    sys.argv = [str(converter), *sys.argv[2:]]
    runpy.run_path(str(converter), run_name="__main__")


if __name__ == "__main__":
    main()
