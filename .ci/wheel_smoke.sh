#!/usr/bin/env bash
# CI: `pip install .` gives a working product. Builds the wheel, installs it (not editable)
# into a fresh virtualenv, and from a directory outside the repository runs the `gigatron`
# command: a 2-iteration CPU pretrain on a zoo model (2 ranks through torchrun) and the
# topology view, then checks that the zoo JSON and the csrc/ kernel sources were installed.
#
# Why a fresh venv without --system-site-packages: CI's Python already holds an editable
# gigatron (the README's test command installs one), and `gigatron` is a namespace package,
# so a venv that sees the system site-packages would merge both and could import from the
# source tree whatever the wheel forgot. The requirements the wheel declares (torch, numpy,
# tokenizers, ...: its Requires-Dist) and what they pull in are hard-linked into the venv
# from this Python's installed files (.ci/link_installed.py, as pip recorded them: a user's
# machine that has them); pip then checks them against the wheel's requirements and installs
# the wheel. The fallback, `pip install torch==2.13.0` and the wheel's requirements from the
# registry, unpacks them again for ~30 s of CPU beside the tests. The venv has no pip of its
# own (ensurepip, ~2 s of CPU): this Python's pip installs into it (--python).
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gigatron-wheel.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
PY=${PYTHON:-python}

echo "== building the wheel (from a copy: a stale build/ in the checkout must not leak in)"
mkdir -p "$WORK/src"
tar -C "$REPO" --exclude=./.git --exclude=./build --exclude='*.egg-info' --exclude=__pycache__ \
    -cf - . | tar -C "$WORK/src" -xf -
"$PY" -m pip wheel --no-deps -q "$WORK/src" -w "$WORK/dist"
WHEEL=$(ls "$WORK"/dist/gigatron-*.whl)

echo "== installing $(basename "$WHEEL") into a fresh venv"
"$PY" -m venv --without-pip "$WORK/venv"
VPY="$WORK/venv/bin/python"
SITE=$("$VPY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
"$PY" "$REPO/.ci/link_installed.py" "$WHEEL" "$SITE" \
  || "$PY" -m pip --python "$VPY" install -q torch==2.13.0
"$PY" -m pip --python "$VPY" install -q "$WHEEL"

mkdir -p "$WORK/outside"
cd "$WORK/outside"   # nothing of the repository is importable from here
export PATH="$WORK/venv/bin:$PATH" OMP_NUM_THREADS=1

echo "== the install holds the package data and no path into the repository"
"$VPY" - "$REPO" <<'PY'
import importlib.util, os, sys
repo = os.path.realpath(sys.argv[1])
import gigatron.cli, gigatron.models.zoo, gigatron.ops.build as build
where = [os.path.realpath(p) for p in gigatron.__path__]
assert not any(p.startswith(repo) for p in where), f"gigatron imported from the repository: {where}"
zoo = os.path.dirname(gigatron.models.zoo.__file__)
names = sorted(f for f in os.listdir(zoo) if f.endswith(".json"))
assert "debug-gpt2.json" in names and len(names) >= 10, names
missing = [str(p) for p in build.source_files() if not p.is_file()]
assert not missing, f"csrc sources missing from the install: {missing}"
print(f"ok: {len(names)} zoo configs, csrc at {build.CSRC}")
PY
for script in pretrain_gpt.py preprocess_data.py train_tokenizer.py; do
  test -x "$WORK/venv/bin/$script" || { echo "missing script $script" >&2; exit 1; }
done

echo "== gigatron --help / topology"
gigatron --help > help.txt
grep -q "^  pretrain " help.txt
python -m gigatron topology --world-size 8 --tp 2 --pp 2 > topology.txt
head -1 topology.txt
grep -q "tp-pp groups (size 4):" topology.txt

echo "== 2-iteration CPU pretrain on the zoo model debug-gpt2, 2 ranks (dp=2)"
torchrun --nproc-per-node 2 --no-python gigatron pretrain --model debug-gpt2 --mock-data \
    --micro-batch-size 2 --global-batch-size 4 --train-iters 2 --lr 1e-3 --log-interval 1 \
    --metrics-file metrics.jsonl 2>&1 | tail -5
"$VPY" - <<'PY'
import json, math
train = [r for r in map(json.loads, open("metrics.jsonl")) if r["type"] == "train"]
assert [r["iteration"] for r in train] == [1, 2], train
assert all(math.isfinite(r["lm loss"]) for r in train), train
print(f"ok: 2 iterations, lm loss {train[-1]['lm loss']:.3f}")
PY
echo "wheel smoke test passed"
