"""Config files: a YAML, TOML or JSON file to the mapping EngineConfig validates, its syntax
errors as one line (file, line, column, the problem). The front ends read files; the core
validates what they read.
"""

from __future__ import annotations

import os
import re
import tomllib
from pathlib import Path
from typing import Any

import yaml

from modserve.core.config import EngineConfig


def config_from_file(path: str | os.PathLike[str], **overrides: Any) -> EngineConfig:
    return EngineConfig.from_dict(load_config_file(path), **overrides)


def load_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The file's top-level mapping, keys with dashes spelled with underscores. A syntax
    error is one ValueError line: file, line, column, the problem."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"config file not found: {path}")
    text = path.read_text()
    if path.suffix == ".toml":
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ValueError(_toml_error(path, e)) from None
    elif path.suffix in (".yaml", ".yml", ".json"):
        try:
            data = yaml.safe_load(text) or {}
        except yaml.YAMLError as e:
            raise ValueError(f"config file {path}: {yaml_error(e)}") from None
    else:
        raise ValueError(f"config file {path} must end in .yaml, .yml, .toml or .json")
    if not isinstance(data, dict):
        raise ValueError(f"config file {path} must hold a mapping at the top level")
    return {str(k).replace("-", "_"): v for k, v in data.items()}


def yaml_error(e: yaml.YAMLError) -> str:
    """``line 3, column 7: mapping values are not allowed here`` from PyYAML's many-line error."""
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    problem = getattr(e, "problem", None) or str(e)
    context = getattr(e, "context", None)
    text = problem + (f" ({context})" if context and context != problem else "")
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return where + " ".join(text.split())


def _toml_error(path: Path, e: tomllib.TOMLDecodeError) -> str:
    msg = str(e)
    found = re.search(r"\s*\(at line (\d+), column (\d+)\)$", msg)
    if found:
        return f"config file {path}: line {found[1]}, column {found[2]}: {msg[:found.start()]}"
    return f"config file {path}: {msg}"
