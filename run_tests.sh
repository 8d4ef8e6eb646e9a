#!/usr/bin/env bash
# ./run_tests.sh [pytest options]: the test suite, in the environment run_train.sh uses (set up on first use).
# e.g. ./run_tests.sh -m "not e2e" (the fast subset), ./run_tests.sh tests/e2e/test_bad_input.py -k config
set -eu
source "$(dirname "${BASH_SOURCE[0]}")/scripts/python_env.sh"  # sets REPO; use_python
use_python torch torchdata numpy pytest matplotlib transformers lightning
cd "$REPO"
exec "$PYTHON" -m pytest -q "$@"
