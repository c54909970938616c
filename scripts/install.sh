#!/usr/bin/env bash
# Installs everything qwen-mk needs on a fresh machine (no GPU needed): the project, its oracle, test, agent,
# serve and bench extras (docs/dependencies.md). torch's CPU build is pinned first so that no dependency pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --upgrade pip
python3 -m pip install -q "torch==2.13.0"
python3 -m pip install -q -e ".[oracle,test,agent,serve,bench]"
