#!/usr/bin/env bash
# Builds (or reuses) a venv holding one torch release, for `make test-torch TORCH=X.Y.Z`,
# and prints its path. `scripts/torch_venv.sh titan` builds the one `make test-titan`
# runs in: torchtitan, torch and the fsspec it needs from constraints-titan.txt.
#
# Why outside the clone: CI clones afresh every run, and a torch wheel from PyPI is a
# CUDA build (5-7 GB with its CUDA libraries, 1-2 min to install), so the venvs live in
# one cache folder, $OBJCKPT_TORCH_VENVS (default ~/.cache/objckpt/torch-venvs), one
# per release, and are reinstalled only when what they were built from changes.
#
# Why PIP_CONFIG_FILE=/dev/null: the development machines' pip config caps torch at
# the release on their disk; these venvs exist to run other releases, so pip reads
# PyPI directly. Everything but torch comes from constraints.txt, as in .venv (for
# titan: everything constraints-titan.txt does not pin itself).
set -euo pipefail
version=${1:?usage: scripts/torch_venv.sh TORCH_VERSION (e.g. 2.9.1) | titan}
cd "$(dirname "$0")/.."
venvs=${OBJCKPT_TORCH_VENVS:-$HOME/.cache/objckpt/torch-venvs}
if [ "$version" = titan ]; then
    venv=$venvs/titan-$(sed -n 's/^torchtitan==//p' constraints-titan.txt)
    packages=(torchtitan --editable '.[s3,test]')
else
    venv=$venvs/torch-$version
    packages=("torch==$version" --editable '.[all,test]')
fi
mkdir -p "$venv"
constraints=$venv/constraints.txt
if [ "$version" = titan ]; then
    # constraints.txt less the packages constraints-titan.txt pins, then that file.
    awk -F'==' 'NR == FNR { if (!/^#/) own[$1]; next } !($1 in own)' \
        constraints-titan.txt constraints.txt >"$constraints.new"
    cat constraints-titan.txt >>"$constraints.new"
else
    { echo "torch==$version"; grep -v '^torch==' constraints.txt; } >"$constraints.new"
fi
# What the venv was built from: its dependencies (the constraints, pyproject.toml) and
# the clone's path (objckpt is installed editable). A fresh clone elsewhere with the
# same dependencies only points the editable install at itself (--no-deps: pip then
# resolves no dependency against PyPI, minutes on a slow index; it still fetches
# setuptools to build the editable wheel); anything else reinstalls. The markers go
# before pip runs, so a failed install is never taken for a finished one.
deps=$(cat "$constraints.new" pyproject.toml | sha256sum | cut -d' ' -f1)
here=$(pwd)
if [ "$(cat "$venv/.installed" 2>/dev/null)" != "$deps" ]; then
    mv "$constraints.new" "$constraints"
    rm -f "$venv/.installed" "$venv/.clone"
    test -x "$venv/bin/python" || python3 -m venv "$venv"
    PIP_CONFIG_FILE=/dev/null "$venv/bin/python" -m pip install --quiet \
        --constraint "$constraints" "${packages[@]}" >&2
    echo "$deps" >"$venv/.installed"
    echo "$here" >"$venv/.clone"
elif [ "$(cat "$venv/.clone" 2>/dev/null)" != "$here" ]; then
    rm -f "$constraints.new" "$venv/.clone"
    PIP_CONFIG_FILE=/dev/null "$venv/bin/python" -m pip install --quiet --no-deps \
        --constraint "$constraints" --editable . >&2
    echo "$here" >"$venv/.clone"
else
    rm -f "$constraints.new"
fi
echo "$venv"
