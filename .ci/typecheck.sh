#!/usr/bin/env bash
# CI: mypy over the gigatron package (config: pyproject.toml [tool.mypy]).
# The folders are mapped into the `gigatron` namespace by setup.py, which a plain
# `pip install -e .` hides inside an import hook no static tool reads. So mypy reads a link
# tree laid out as installed (package/'s files plus a link per setup.py TOP_LEVEL folder) in
# a temporary folder, through MYPYPATH: nothing is reinstalled, so this runs beside pytest
# (.ci/run starts both at once) without changing what the tests import.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
# (asking the installed metadata first: pip's check of a satisfied pin is ~2 s of CPU)
"$PY" -c "import importlib.metadata as m, sys; sys.exit(m.version('mypy') != '2.4.1')" 2>/dev/null \
  || "$PY" -m pip install -q "mypy==2.4.1"
TREE=$(mktemp -d "${TMPDIR:-/tmp}/gigatron-types.XXXXXX")
trap 'rm -rf "$TREE"' EXIT
mkdir "$TREE/gigatron"
for f in package/*.py package/py.typed; do ln -s "$PWD/$f" "$TREE/gigatron/"; done
for top in $("$PY" -c "import ast; t = ast.parse(open('setup.py').read()); print(' '.join(next(ast.literal_eval(n.value) for n in t.body if isinstance(n, ast.Assign) and getattr(n.targets[0], 'id', '') == 'TOP_LEVEL')))"); do
  ln -s "$PWD/$top" "$TREE/gigatron/$top"
done
# one cold run: no cache to write (--cache-dir /dev/null, mypy's way to turn it off)
MYPYPATH="$TREE" "$PY" -m mypy --config-file pyproject.toml --cache-dir /dev/null -p gigatron
