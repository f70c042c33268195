#!/usr/bin/env bash
# The wheels the GPU gate needs that the H200's image lacks, downloaded here (a machine with PyPI) into .whl/ for
# Python 3.12 on x86-64 Linux: xgrammar (the sweeps' structured-output requests) and what it needs beyond the
# image (apache-tvm-ffi, pydantic and its parts, a newer typing-extensions). The device call carries .whl
# (ignored by git); tools/gpu_check.sh installs them into /tmp/site before it starts.
#   bash tools/fetch_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .whl
for p in xgrammar==0.2.9 apache-tvm-ffi pydantic pydantic-core annotated-types typing-inspection typing-extensions; do
  python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "$p"
done
ls .whl
