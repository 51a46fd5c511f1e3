#!/usr/bin/env bash
# make python-matrix: install minitp with the pinned versions into a fresh virtual environment per
# Python, then run the library's tests and every chapter under nbval there. Each Python the README
# promises must pass.
#
#   tools/python_matrix.sh [VERSION ...]     (default: 3.11 3.12 3.13, found with pyenv or on PATH)
#
# Environments go to build/python-matrix/pyX.Y (kept: a second run reuses them); each version's log
# to build/python-matrix/pyX.Y.log, and one line per version to build/python-matrix/summary.txt.
# torch: where no wheel of the pinned version lies on this machine, pip takes PyPI's, which for Linux
# is the CUDA build (about 3 GB with its libraries); MATRIX_PIP_ARGS passes pip more, e.g.
# "--extra-index-url https://download.pytorch.org/whl/cpu" for the CPU build.
# MATRIX_TESTS="tests -m 'not site'" and MATRIX_NOTEBOOKS="notebooks" choose what runs (the site's
# build and browser checks do not depend on the Python that runs them, and run in make test).
set -uo pipefail
cd "$(dirname "$0")/.."

versions=("$@")
[ "${#versions[@]}" -gt 0 ] || versions=(3.11 3.12 3.13)
out=build/python-matrix
mkdir -p "$out"
: > "$out/summary.txt"
tests_args=${MATRIX_TESTS:-"tests -m 'not site'"}
notebooks_args=${MATRIX_NOTEBOOKS:-notebooks}
nbval="--nbval --nbval-current-env --nbval-sanitize-with tests/nbval_sanitize.cfg"
failed=0

find_python() {  # the interpreter of Python $1: pyenv's newest X.Y.*, else pythonX.Y on PATH
  local prefix
  if command -v pyenv >/dev/null 2>&1; then
    prefix=$(pyenv root)/versions
    local best
    best=$(ls -d "$prefix/$1".* 2>/dev/null | sort -V | tail -1)
    [ -n "$best" ] && [ -x "$best/bin/python" ] && { echo "$best/bin/python"; return; }
  fi
  command -v "python$1" 2>/dev/null
}

for v in "${versions[@]}"; do
  py=$(find_python "$v")
  log="$out/py$v.log"
  if [ -z "$py" ]; then
    echo "py$v: no Python $v here (pyenv install $v, or put python$v on PATH)" | tee -a "$out/summary.txt"
    failed=1
    continue
  fi
  env="$out/py$v"
  start=$(date +%s)
  {
    echo "== $("$py" --version) ($py)"
    test -x "$env/bin/python" || "$py" -m venv "$env"
    "$env/bin/python" -m pip install --quiet --upgrade pip &&
      "$env/bin/python" -m pip install --quiet -c constraints.txt ${MATRIX_PIP_ARGS:-} -e ".[course,dev]"
  } > "$log" 2>&1
  if [ $? -ne 0 ]; then
    echo "py$v: the pinned set did not install ($(tail -1 "$log")); see $log" | tee -a "$out/summary.txt"
    failed=1
    continue
  fi
  installed=$(( $(date +%s) - start ))
  eval "\"$env/bin/python\" -m pytest -q -p no:cacheprovider $tests_args" >> "$log" 2>&1
  tests_rc=$?
  tests_line=$(grep -E '^[0-9]+ (passed|failed)|[0-9]+ (passed|failed).* in ' "$log" | tail -1)
  tested=$(( $(date +%s) - start ))
  eval "\"$env/bin/python\" -m pytest -q -p no:cacheprovider $notebooks_args $nbval" >> "$log" 2>&1
  notebooks_rc=$?
  notebooks_line=$(grep -E '[0-9]+ (passed|failed).* in ' "$log" | tail -1)
  total=$(( $(date +%s) - start ))
  verdict=passed
  { [ $tests_rc -ne 0 ] || [ $notebooks_rc -ne 0 ]; } && { verdict=FAILED; failed=1; }
  echo "py$v: $verdict in ${total}s (install ${installed}s, tests $((tested - installed))s: $tests_line;" \
       "notebooks $((total - tested))s: $notebooks_line)" | tee -a "$out/summary.txt"
done
exit $failed
