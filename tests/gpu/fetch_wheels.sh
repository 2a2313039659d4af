#!/usr/bin/env bash
# Run on a machine WITH network, before taking the tree to a bare GPU machine (no network):
# downloads the wheels tests/gpu/check.sh installs there into .whl/ (git-ignored; it travels
# with the working tree). The GPU image brings Python 3.12, CUDA torch, Triton, numpy, grpcio and
# tokenizers; everything else the daemon and the GPU tests import comes from here, pinned to the
# versions this checkout's venv tests with (tests/gpu/wheel_list.py), binary wheels only.
# Usage, from the repository root:  bash tests/gpu/fetch_wheels.sh
#   PYVER=3.12 (target Python)  WHEELS=.whl (folder)  PYTHON=.venv/bin/python (for the list)
set -euo pipefail
cd "$(dirname "$0")/../.."
py=${PYTHON:-.venv/bin/python}
pyver=${PYVER:-3.12}
dest=${WHEELS:-.whl}
mkdir -p "$dest"
mapfile -t reqs < <("$py" tests/gpu/wheel_list.py "$pyver")
abi="cp${pyver/./}"
"$py" -m pip download -q --no-deps --only-binary=:all: -d "$dest" \
    --python-version "$pyver" --implementation cp --abi "$abi" --abi abi3 --abi none \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any \
    "${reqs[@]}"
printf '%s\n' "${reqs[@]}" > "$dest/requirements.txt"
echo "$pyver" > "$dest/python-version"  # check.sh refuses an interpreter of another version
total=$(du -sm "$dest" | cut -f1)
echo "$(find "$dest" -maxdepth 1 -name '*.whl' | wc -l) wheels, ${total} MiB in $dest (Python $pyver)"
if [ "$total" -ge 60 ]; then
    echo "over the 60 MiB budget" >&2
    exit 1
fi
