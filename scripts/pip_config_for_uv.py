"""Print `export` lines that give uv the package indexes pip is configured with.

uv reads none of pip's configuration (pip.conf, PIP_* variables); `make install` evals this
before `uv pip install`, so both installers see the same indexes, links and constraints:

    eval "$(.venv/bin/python scripts/pip_config_for_uv.py constraints.txt)"

Constraint files given as arguments join pip's in UV_CONSTRAINT: uv's `-c` on the command
line would replace the variable, not add to it.

pip takes the best version across all its indexes; uv by default takes each package from
the first index that has it, so UV_INDEX_STRATEGY=unsafe-best-match keeps pip's choice.
Variables already set for uv are left alone.
"""

from __future__ import annotations

import ast
import shlex
import subprocess
import sys

# pip's option -> (uv's variable, how uv separates several values)
OPTIONS = {
    "index-url": ("UV_INDEX_URL", " "),
    "extra-index-url": ("UV_EXTRA_INDEX_URL", " "),
    "find-links": ("UV_FIND_LINKS", ","),
    "constraint": ("UV_CONSTRAINT", " "),  # with the files given as arguments: see main
    "cert": ("SSL_CERT_FILE", " "),
    "client-cert": ("SSL_CLIENT_CERT", " "),
    "timeout": ("UV_HTTP_TIMEOUT", " "),
    "default-timeout": ("UV_HTTP_TIMEOUT", " "),
    "trusted-host": ("UV_INSECURE_HOST", " "),
    "proxy": ("HTTPS_PROXY", " "),
}
# pip's precedence: environment variables, then the [install] section, then [global].
SECTIONS = (":env:", "install", "global")


def pip_settings(python: str) -> dict[str, str]:
    out = subprocess.run([python, "-m", "pip", "config", "list"], capture_output=True, text=True, check=True).stdout
    found: dict[tuple[str, str], str] = {}
    for line in out.splitlines():
        key, sep, value = line.partition("=")
        section, _, name = key.rpartition(".")
        if sep and section in SECTIONS:
            found[section, name] = ast.literal_eval(value)  # pip prints repr(): a multi-line value shows \n
    settings = {}
    for name in OPTIONS:
        for section in SECTIONS:
            if (section, name) in found:
                settings[name] = found[section, name]
                break
    return settings


def main() -> int:
    lines = ["export UV_INDEX_STRATEGY=${UV_INDEX_STRATEGY:-unsafe-best-match}"]
    settings = pip_settings(sys.executable)
    constraints = " ".join([*settings.pop("constraint", "").split(), *sys.argv[1:]])
    for name, value in settings.items():
        var, sep = OPTIONS[name]
        lines.append(f"export {var}=${{{var}:-{shlex.quote(sep.join(value.split()))}}}")
    if constraints:
        lines.append(f"export UV_CONSTRAINT=${{UV_CONSTRAINT:+$UV_CONSTRAINT }}{shlex.quote(constraints)}")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
