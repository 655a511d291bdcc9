#!/usr/bin/env bash
# The tests marked `slow` (left out of the default `python -m pytest` run), then 100 random
# draws of the randomized model-based test (the default run has 16 fixed ones).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pytest -m slow -n 0 "$@"  # one at a time: some time themselves
CHECKFREE_EXAMPLES=100 python -m pytest -n 0 tests/test_exact_everywhere.py -k every_job --timeout 3600
