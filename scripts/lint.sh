#!/usr/bin/env bash
# Lint and types, the first step of `make test` (scripts/run-tests.sh); also on its own:
# `bash scripts/lint.sh`. ruff (pyflakes, isort, pyupgrade, bugbear) and mypy on every Python file of
# the repo, tests and bench included (settings in pyproject.toml; tests/unit/test_lint_coverage.py
# checks nothing is left out), shellcheck on the project's shell scripts and on every
# templates/*.sh.j2 rendered with representative values (`python -m plan.render --check-shell`,
# the values: plan/render.py SHELL_EXAMPLES). Every tool runs;
# the exit status is non-zero when any of them reports a finding. Caches live under .cache/.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
VENV=${VENV:-.venv}
PY_PATHS=(.)  # ruff: the whole tree, less the excludes in pyproject.toml (caches, twins, build output)
SHELL_SCRIPTS=(scripts/*.sh .ci/run bench/*.sh tests/twin/twinctl)
failed=()
step() {  # step NAME COMMAND...: run it, say what ran and how it went
  local name=$1 start rc; shift
  start=$(date +%s)
  echo "pvegpu lint: $name: $*"
  "$@"
  rc=$?
  echo "pvegpu lint: $name: $([ "$rc" = 0 ] && echo clean || echo "FAILED (rc=$rc)"), $(( $(date +%s) - start )) s"
  [ "$rc" = 0 ] || failed+=("$name")
}
for tool in "$VENV/bin/ruff" "$VENV/bin/mypy"; do
  [ -x "$tool" ] || { echo "pvegpu lint: $tool is missing; run \`make venv\`" >&2; exit 1; }
done
command -v shellcheck >/dev/null || { echo "pvegpu lint: shellcheck is missing; run \`make debs\`" >&2; exit 1; }
mkdir -p .cache
step ruff "$VENV/bin/ruff" check --no-fix "${PY_PATHS[@]}"
step mypy "$VENV/bin/mypy"  # files, excludes and the cache dir: [tool.mypy] in pyproject.toml
step shellcheck shellcheck "${SHELL_SCRIPTS[@]}"
step shell-templates "$VENV/bin/python" -m plan.render --check-shell --templates templates
if ((${#failed[@]})); then
  echo "pvegpu lint: failed: ${failed[*]}" >&2
  exit 1
fi
echo "pvegpu lint: all clean"
