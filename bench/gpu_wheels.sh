#!/usr/bin/env bash
# Fetch, on a machine with the package index, the wheels the device machine lacks (it has no
# index): megatron-core and torchtitan 0.3.0 with its pure-Python needs, for the device's
# Python 3.12 on x86-64. They land in .whl/ (ignored through .git/info/exclude, never
# committed: about 4.4 MB), travel with the working tree when the device call names .whl in
# carry, and bench/gpu_session.sh installs them there with --no-index --no-deps.
#
#   bash bench/gpu_wheels.sh            # from the repository root, before the device call
set -eu
PY=${GPU_PYTHON_VERSION:-3.12}
grep -qx "/.whl/" .git/info/exclude 2>/dev/null || echo "/.whl/" >> .git/info/exclude
# one version of each (two stop the install there); triton, numpy, safetensors and
# typing_extensions are in the device image
python3 -m pip download --no-deps --only-binary=:all: --python-version "$PY" \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl \
  megatron-core==0.16.1 torchtitan==0.3.0 spmd_types==0.2.3 torch_checkpointing==0.1.1 \
  tyro==1.0.17 docstring_parser==0.18.0 typeguard==4.6.1
ls -l .whl
