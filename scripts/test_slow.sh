#!/usr/bin/env bash
# The tests marked `slow` (left out of the default `python -m pytest` run), then nothing else.
set -euo pipefail
cd "$(dirname "$0")/.."
exec python -m pytest -m slow "$@"
