#!/usr/bin/env bash
# Fetch into .whl/ (ignored by git) the wheels a lent GPU machine lacks, for its Python 3.12 on
# x86-64; scripts/gpu_check.sh installs them there (pip --target /tmp/site) before anything runs.
#
#   bash scripts/gpu_wheels.sh        # then name .whl in the device call's carry
#
# Which: what `from modserve import LLM` and a generate import (pydantic and its needs; the rest
# of pyproject's runtime list is on that machine, /work/.library/device/KINDS.md), plus what
# tests/test_cuda.py's guided-decoding tests import (xgrammar, apache-tvm-ffi, outlines_core) and
# platformdirs (modserve.testing's default cache). The server's fastapi/uvicorn are left out: no
# GPU check starts a server. Versions are this venv's; typing_extensions travels because pydantic
# 2.14 needs >= 4.16, newer than the machine's may be. About 10 MB in all.
set -euo pipefail
cd "$(dirname "$0")/.."

WHEELS=(
    pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
    typing_extensions==4.16.0 platformdirs==4.14.9
    xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2 outlines_core==0.2.14
)
PLATFORMS=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
         manylinux2014_x86_64 manylinux1_x86_64; do
    PLATFORMS+=(--platform "$p")
done
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3

rm -rf .whl
mkdir -p .whl
for w in "${WHEELS[@]}"; do  # one at a time: a missing one names itself
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${PLATFORMS[@]}" -d .whl "$w" 2>&1 | grep -v "is ignored: it is neither a file nor a directory" || true
    ls .whl/"$(echo "${w%%==*}" | tr - _)"-* >/dev/null 2>&1 || { echo "no wheel for $w" >&2; exit 1; }
done
ls -l .whl
du -sh .whl
