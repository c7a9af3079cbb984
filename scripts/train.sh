#!/usr/bin/env bash
# The README's main-job command: sets up .venv (scripts/setup.sh) and trains the perception
# model on the bundled real market data. Arguments go to examples/train_perception.py.
set -euo pipefail
cd "$(dirname "$0")/.."
JAXFOX_EXTRAS= source scripts/setup.sh
exec python examples/train_perception.py "$@"
