#!/usr/bin/env bash
# CI: mypy over the gigatron package (config: pyproject.toml [tool.mypy]).
# The folders are mapped into the `gigatron` namespace by setup.py, so mypy resolves
# `gigatron.*` through a strict editable install: a link tree of the sources that any static
# tool can read (a plain `pip install -e .` hides the mapping inside an import hook).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
"$PY" -m pip install -q "mypy==2.4.1"
"$PY" -m pip install -q --no-deps -e . --config-settings editable_mode=strict
"$PY" -m mypy --config-file pyproject.toml -p gigatron
