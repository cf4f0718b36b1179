#!/usr/bin/env bash
# `make test`: lint and types first (scripts/lint.sh: ruff, mypy, shellcheck; any finding fails
# the run before a test starts), then every test, as a queue of pytest runs that PVEGPU_TEST_JOBS
# (default 3: as many as the processes side by side before it; the timing tests of the twin hold
# at that load on 2 cores, not at 4 beside other work) slots take in turn (xargs -P): one run per end-to-end or twin file, one for tests/unit.
# The queue starts with the longest runs (SLOW_FIRST: the real NVIDIA and kernel builds, then the
# long end-to-end files), so that the slots end close together; a file not named there runs after
# them, in name order. pytest-xdist cannot do this here: pyinfra_cli patches threads with gevent
# at import, which breaks execnet's workers.
# Twins of different runs never clash: a twin's address is picked under .twin/.lock and every fixed
# twin name is one test's, the others hold the pytest pid (tests/twin/fixtures.py). Each run logs to
# .cache/test-logs/<file>.log; at the end a table of every run (rc, seconds) and the whole log of
# each failed run are printed. Extra arguments go to every pytest run (a run that then collects no
# test counts as passed).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
PYTEST=.venv/bin/pytest
JOBS=${PVEGPU_TEST_JOBS:-3}
# longest first. An entry of several files (space-separated) is one run, in that order: the
# build-sharing e2e after the bookworm NVIDIA build, whose ccache and conftest results it starts
# from (PVEGPU_E2E_NVIDIA_CACHE_OUT -> PVEGPU_E2E_NVIDIA_CACHE: the same inputs; the cold build is
# test_driver_build.py's, the sharing is the other's to prove); likewise the kernel's build-sharing
# e2e after the kernel build, whose kernel ccache (.cache/kernel-ccache) seeds its builder. CPU
# seconds of the runs (2026-12-06 CI, the table's CPU column): the NVIDIA build + sharing 751, the
# kernel build + sharing 589, tests/unit 202, the power cut 172, the kernel trial 179, the rest
# under 80 each; the CPUs were 99% busy, so the sum decides the time
SLOW_FIRST=("tests/e2e/test_driver_build.py tests/e2e/test_build_share_e2e.py"
            tests/unit "tests/e2e/test_kernel_build.py tests/e2e/test_kernel_share_e2e.py" tests/e2e/test_power_cut_e2e.py
            tests/e2e/test_kernel_upgrade_e2e.py tests/e2e/test_pve9_e2e.py
            tests/e2e/test_kernel_trial_e2e.py tests/e2e/test_cluster_e2e.py tests/e2e/test_rebind_faults_e2e.py
            tests/e2e/test_host_checks_e2e.py tests/e2e/test_boot_reinit_e2e.py tests/e2e/test_whole_run.py
            tests/e2e/test_faults.py tests/e2e/test_kernel_gate_e2e.py tests/e2e/test_docs_run.py)
NVIDIA_SEED=$PWD/.cache/nvidia-seed
rm -rf "$NVIDIA_SEED"
export PVEGPU_E2E_NVIDIA_CACHE_OUT=$NVIDIA_SEED PVEGPU_E2E_NVIDIA_CACHE=$NVIDIA_SEED
# the slow lane (`make test-slow`), not run here, as 30 minutes leave no room for them on 2 cores: the
# real 8 -> 9 apt full-upgrade (~8-10 min a case warm on 2 busy cores, 2026-12-06: 558 s and 462 s)
# and trixie's cold NVIDIA build with GCC 14 (786 CPU seconds: a second cold build of the whole
# src/ tree beside bookworm's, ~13 min of the 2-core CI's 51 at 99% busy on 2026-12-06)
SLOW_LANE=(tests/e2e/test_driver_build_trixie.py tests/e2e/test_dist_upgrade_e2e.py)
LOGS=.cache/test-logs
mkdir -p .cache
rm -rf "$LOGS"
mkdir -p "$LOGS"
start=$(date +%s)
cache() {  # a twin root cache is shared by the runs: built once (under its lock), before the tests that use it
  tests/twin/twinctl cache --suite "$1" >/dev/null || { echo "pvegpu: could not build the twin root cache ($1)" >&2; return 1; }
}
# lint (CPU) beside the two twin roots' builds (debootstrap: mostly network and disk, each root under
# its own lock, so both build at once while the CPU is still idle); still no test starts before lint
# is clean. Trixie's root (kpro6-pve9) may still be building when the tests start: a run that needs
# it waits on its lock (before 2026-12-06 it started only after bookworm's, and trixie's NVIDIA build
# waited ~300 s for it beside the three builds)
lint_log=.cache/lint.log
bash scripts/lint.sh >"$lint_log" 2>&1 &
lint_pid=$!
cache trixie &
trixie_pid=$!
cache bookworm  # Proxmox VE 8 profiles
bookworm_rc=$?
wait "$lint_pid"
lint_rc=$?
cat "$lint_log"
# a failed start leaves nothing running: trixie's root build is waited for (it ends by itself)
[ "$lint_rc" = 0 ] || { echo "pvegpu: lint failed (scripts/lint.sh); no test ran" >&2; wait "$trixie_pid"; exit 1; }
[ "$bookworm_rc" = 0 ] || { wait "$trixie_pid"; exit 1; }

queue=()
declare -A queued=()
for f in "${SLOW_LANE[@]}"; do queued[$f]=1; done
for entry in "${SLOW_FIRST[@]}" tests/twin/test_*.py tests/e2e/test_*.py; do
  fresh=()
  for f in $entry; do
    [ -e "$f" ] || { echo "pvegpu: $f (run-tests.sh SLOW_FIRST) does not exist" >&2; exit 1; }
    [ -n "${queued[$f]:-}" ] || fresh+=("$f")
    queued[$f]=1
  done
  [ "${#fresh[@]}" = 0 ] || queue+=("${fresh[*]}")
done

# one run: its log, then "<rc> <seconds>" in <log>.rc
run_one() {
  local f=$1; shift
  local log="${f%% *}" t0 rc files
  log="$LOGS/${log//\//_}.log"
  read -r -a files <<<"$f"
  t0=$(date +%s)
  "$PYTEST" -p no:cacheprovider --durations=5 "${files[@]}" "$@" >"$log" 2>&1
  rc=$?
  [ "$rc" = 5 ] && rc=0  # no test collected (extra arguments deselected the file's tests)
  # CPU seconds of the run's processes (bash's `times`, children's user and system: pytest and what
  # it waited for, the twins it started and their builds included); `times` in this shell, not a pipe's
  local cpu
  times >"$log.times"
  cpu=$(awk 'NR==2 {for (i = 1; i <= 2; i++) {split($i, t, /[ms]/); s += t[1] * 60 + t[2]}; printf "%d", s}' "$log.times")
  echo "$rc $(( $(date +%s) - t0 )) $cpu" >"$log.rc"
  echo "pvegpu tests: $f rc=$rc $(( $(date +%s) - t0 )) s, CPU $cpu s"
}
export -f run_one
export PYTEST LOGS
# how busy the machine's CPUs were while the runs went (from /proc/stat: every process, twins and
# their builds included): near all cores busy means only less work makes `make test` shorter
cpu_ticks() { awk '/^cpu /{busy=$2+$3+$4+$7+$8+$9; print busy, busy+$5+$6}' /proc/stat; }
read -r busy0 total0 < <(cpu_ticks)
queue_t0=$(date +%s)
printf '%s\0' "${queue[@]}" | xargs -0 -P "$JOBS" -I{} bash -c 'run_one "$@"' _ {} "$@"

read -r busy1 total1 < <(cpu_ticks)
queue_secs=$(( $(date +%s) - queue_t0 ))
wait "$trixie_pid"
trixie_rc=$?
failed=()
echo
echo "===== ${#queue[@]} pytest runs, $JOBS at a time (logs: $LOGS/) ====="
logof() { local l="${1%% *}"; echo "$LOGS/${l//\//_}.log"; }
for f in "${queue[@]}"; do
  log=$(logof "$f")
  read -r rc secs cpu <"$log.rc" 2>/dev/null || { rc=missing; secs=-; cpu=-; }
  printf '%-60s rc=%-7s %5s s  CPU %5s s  %s\n' "$f" "$rc" "$secs" "$cpu" "$(tail -n 1 "$log" 2>/dev/null)"
  [ "$rc" = 0 ] || failed+=("$f")
done
for f in "${failed[@]}"; do
  echo
  echo "===== FAILED: $f ($(logof "$f")) ====="
  cat "$(logof "$f")"
done
[ "$trixie_rc" = 0 ] || echo "pvegpu: could not build trixie's twin root (see above)" >&2
cores=$(nproc)
echo "pvegpu tests: the runs took $queue_secs s after $(( queue_t0 - start )) s of lint and twin roots;" \
     "CPUs busy $(( (busy1 - busy0) * 100 / (total1 - total0 > 0 ? total1 - total0 : 1) ))% of $cores over the runs"
echo "pvegpu tests: ${#queue[@]} runs, ${#failed[@]} failed, trixie root rc=$trixie_rc, $(( $(date +%s) - start )) s"
[ "${#failed[@]}" = 0 ] && [ "$trixie_rc" = 0 ]
