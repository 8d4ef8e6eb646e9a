# Sourced by run_train.sh and run_tests.sh: `use_python MODULE...` sets PYTHON to an interpreter that can
# import every MODULE, so that a fresh clone on a machine with only Python 3 works as the README says.
#   PYTHON set     -> that one, or one line and exit 2 when it lacks a module;
#   otherwise      -> .venv in the repository, else python or python3 on PATH, when it has them all;
#   .venv trains but lacks a module -> the project's extras named in EXTRAS are installed into it, once;
#   none has them  -> set up .venv on first use (torch, then this project with the extras in EXTRAS).
# EXTRAS: what the caller needs beyond training (run_tests.sh: the test, plot, hf, lightning and torchtitan
# extras); empty for run_train.sh, so a first training run installs only what training needs.
# TORCHTITAN_RNG_TORCH: what that set-up asks pip for torch (default: torch==2.13.0, a CPU build here;
# "torch>=2.11,<2.16" where nvidia-smi sees a GPU). It is split into words, so pip options may follow.

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

_fail() {
  echo "error: $*" >&2
  exit 2
}

# Whether interpreter $1 is Python >= 3.10 and finds every module after it (without importing them: fast).
_has_modules() {
  local py=$1
  shift
  "$py" - "$@" >/dev/null 2>&1 <<'EOF'
import importlib.util
import sys

needed = sys.argv[1:] + (["tomli"] if sys.version_info < (3, 11) else [])
sys.exit(0 if sys.version_info >= (3, 10) and all(importlib.util.find_spec(name) for name in needed) else 1)
EOF
}

_set_up_venv() {
  local venv=$REPO/.venv base torch_req
  base=$(command -v python3 || command -v python) || _fail "no python3 on PATH; install Python 3.10 or newer"
  "$base" -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
    || _fail "$base is Python $("$base" -c 'import platform; print(platform.python_version())'); this project needs 3.10 or newer (or set PYTHON=...)"
  torch_req=${TORCHTITAN_RNG_TORCH:-}
  if [ -z "$torch_req" ]; then
    if nvidia-smi -L 2>/dev/null | grep -q GPU; then torch_req="torch>=2.11,<2.16"; else torch_req="torch==2.13.0"; fi
  fi
  echo "$(basename "$0"): no Python here has torch and torchdata; setting up $venv ($torch_req, then this project$(_extras_words)) once, log in $venv/setup.log"
  local out
  out=$("$base" -m venv "$venv" 2>&1) \
    || _fail "'$base -m venv $venv' failed ($(echo "$out" | tail -n 1)); install the venv module (Debian/Ubuntu: apt install python3-venv) or set PYTHON=..."
  local log=$venv/setup.log
  # shellcheck disable=SC2086  # word splitting lets TORCHTITAN_RNG_TORCH carry pip options
  "$venv/bin/python" -m pip install $torch_req >"$log" 2>&1 \
    || _fail "installing $torch_req into $venv failed (last line: $(tail -n 1 "$log")); see $log, or set TORCHTITAN_RNG_TORCH"
  "$venv/bin/python" -m pip install -e "$REPO${EXTRAS:+[$EXTRAS]}" >>"$log" 2>&1 \
    || _fail "installing this project into $venv failed (last line: $(tail -n 1 "$log")); see $log"
}

_extras_words() {
  [ -z "${EXTRAS:-}" ] || echo " with its ${EXTRAS//,/, } extras"
}

# .venv was set up for training (run_train.sh); the caller needs more of the project's extras.
_add_extras() {
  local venv=$REPO/.venv
  local log=$venv/setup.log
  echo "$(basename "$0"): installing this project's ${EXTRAS//,/, } extras into $venv once, log in $log"
  "$venv/bin/python" -m pip install -e "$REPO[$EXTRAS]" >>"$log" 2>&1 \
    || _fail "installing the extras $EXTRAS into $venv failed (last line: $(tail -n 1 "$log")); see $log"
}

use_python() {
  if [ -n "${PYTHON:-}" ]; then
    command -v "$PYTHON" >/dev/null || _fail "PYTHON=$PYTHON is not a program; set it to a Python interpreter or unset it"
    _has_modules "$PYTHON" "$@" \
      || _fail "PYTHON=$PYTHON cannot import $* (or is older than Python 3.10); install them there (pip install -e \"$REPO${EXTRAS:+[$EXTRAS]}\") or unset PYTHON to have $REPO/.venv set up"
    return
  fi
  local candidate
  for candidate in "$REPO/.venv/bin/python" python python3; do
    if command -v "$candidate" >/dev/null && _has_modules "$candidate" "$@"; then
      PYTHON=$candidate
      return
    fi
  done
  if [ -n "${EXTRAS:-}" ] && [ -x "$REPO/.venv/bin/python" ] && _has_modules "$REPO/.venv/bin/python" torch torchdata; then
    _add_extras
  else
    _set_up_venv
  fi
  PYTHON=$REPO/.venv/bin/python
  _has_modules "$PYTHON" "$@" || _fail "$REPO/.venv was set up but cannot import $*; see $REPO/.venv/setup.log"
}
