#!/usr/bin/env bash
# Builds (or reuses) a venv holding one torch release, for `make test-torch TORCH=X.Y.Z`,
# and prints its path.
#
# Why outside the clone: CI clones afresh every run, and a torch wheel from PyPI is a
# CUDA build (5-7 GB with its CUDA libraries, 1-2 min to install), so the venvs live in
# one cache folder, $OBJCKPT_TORCH_VENVS (default ~/.cache/objckpt/torch-venvs), one
# per release, and are reinstalled only when what they were built from changes.
#
# Why PIP_CONFIG_FILE=/dev/null: the development machines' pip config caps torch at
# the release on their disk; these venvs exist to run other releases, so pip reads
# PyPI directly. Everything but torch comes from constraints.txt, as in .venv.
set -euo pipefail
version=${1:?usage: scripts/torch_venv.sh TORCH_VERSION (e.g. 2.9.1)}
cd "$(dirname "$0")/.."
venv=${OBJCKPT_TORCH_VENVS:-$HOME/.cache/objckpt/torch-venvs}/torch-$version
mkdir -p "$venv"
constraints=$venv/constraints.txt
{ echo "torch==$version"; grep -v '^torch==' constraints.txt; } >"$constraints.new"
# The clone's path is part of what the venv was built from: objckpt is installed
# editable, so a fresh clone elsewhere needs it installed again (no downloads then).
want=$(cat "$constraints.new" pyproject.toml <(pwd) | sha256sum | cut -d' ' -f1)
if [ "$(cat "$venv/.installed" 2>/dev/null)" != "$want" ]; then
    mv "$constraints.new" "$constraints"
    test -x "$venv/bin/python" || python3 -m venv "$venv"
    PIP_CONFIG_FILE=/dev/null "$venv/bin/python" -m pip install --quiet \
        --constraint "$constraints" "torch==$version" --editable '.[all,test]' >&2
    echo "$want" >"$venv/.installed"
else
    rm -f "$constraints.new"
fi
echo "$venv"
