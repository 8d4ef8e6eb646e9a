#!/usr/bin/env bash
# ./run_tests.sh [pytest options]: the test suite, in the environment run_train.sh uses (the test extras are
# installed into it on first use), on one pytest worker per core (TEST_WORKERS=N for another count). Without
# a -m option it runs every test but the slow tier (-m slow: the fresh-install, cross-Python, full-disk,
# cluster-recipe, real-SLURM and feature-alone tests, which CI adds).
# e.g. ./run_tests.sh -m "not e2e" (the fast subset), ./run_tests.sh tests/e2e/test_bad_input.py -k config
set -eu
source "$(dirname "${BASH_SOURCE[0]}")/scripts/python_env.sh"  # sets REPO; use_python
EXTRAS=test,plot,hf,lightning,torchtitan use_python torch torchdata numpy pytest xdist matplotlib transformers \
  lightning s3fs moto
cd "$REPO"
case " $* " in
  *" -m "* | *" -m"?*) ;;
  *) set -- -m "not slow" "$@" ;;
esac
# Workers share the cores through tests/support/cores.py: a run starts when its processes have a core each.
exec "$PYTHON" -m pytest -q -n "${TEST_WORKERS:-$(nproc)}" --dist loadgroup "$@"
