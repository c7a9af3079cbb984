#!/usr/bin/env bash
# One visit to the lent GPU machine (no network there): build jaxfox in place, then run the phases named
# on the command line, each logging to $OUT/<phase>.log, and stop starting new phases once the budget
# (seconds, JAXFOX_VISIT_BUDGET, default 540: a device command may run 600 s) is spent.
#
#   bash tools/gpu_visit.sh build test:optim sanitize:optim bench:adamw,cfc_scan
#
# Phases: build | test:<module,...> (tests/test_gpu_<module>.py, `pytest -m gpu`) |
#         sanitize:<name,...> (memcheck + racecheck of tests/gpu_sanitize_<name>.py; "" = gpu_sanitize.py) |
#         bench:<op,...> (python -m jaxfox.bench --ops ... --repeats 3, JSON to $OUT/bench.json).
# Wheels that the machine lacks (arch, ...) travel in .whl (see the device tool's README) and are installed
# first when that folder exists. Every phase runs even when an earlier one failed; the exit code is the
# number of failed phases.
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/jaxfox-visit}"
mkdir -p "$OUT"
budget="${JAXFOX_VISIT_BUDGET:-540}"
start=$(date +%s)
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
failed=0
for phase in "$@"; do
  left=$(( budget - ($(date +%s) - start) ))
  if [ "$left" -le 20 ]; then echo "SKIPPED $phase (budget spent)" | tee -a "$OUT/summary.log"; continue; fi
  name="${phase%%:*}"; arg="${phase#*:}"; [ "$arg" = "$phase" ] && arg=""
  log="$OUT/${name}${arg:+_${arg//,/_}}.log"
  t0=$(date +%s)
  case "$name" in
    build)
      timeout "$left" python3 -m pip install --no-build-isolation --no-deps -e . >"$log" 2>&1 \
        && (cd /tmp && python3 -c "import jaxfox; assert jaxfox.kernels_available(), jaxfox.kernels_unavailable_reason(); print('kernels available')") >>"$log" 2>&1 ;;
    test)
      files=(); for m in ${arg//,/ }; do files+=("$PWD/tests/test_gpu_${m}.py"); done
      (cd /tmp && timeout "$left" python3 -m pytest -q -m gpu -p no:cacheprovider --rootdir "$OLDPWD" "${files[@]}") >"$log" 2>&1 ;;
    sanitize)
      rc=0
      for s in ${arg:-_}; do
        for s1 in ${s//,/ }; do
          script="tests/gpu_sanitize${s1:+_$s1}.py"; [ "$s1" = "_" ] && script="tests/gpu_sanitize.py"
          for tool in memcheck racecheck; do
            echo "== $tool $script" >>"$log"
            (cd /tmp && timeout "$left" compute-sanitizer --tool "$tool" --error-exitcode 3 python3 "$OLDPWD/$script") >>"$log" 2>&1 || rc=1
          done
        done
      done
      [ "$rc" = 0 ] ;;
    bench)
      (cd /tmp && timeout "$left" python3 -m jaxfox.bench --ops "$arg" --repeats 3 --json "$OUT/bench_${arg//,/_}.json") >"$log" 2>&1 ;;
    *) echo "unknown phase $phase" >"$log"; false ;;
  esac
  rc=$?
  [ "$rc" = 0 ] || failed=$((failed + 1))
  echo "$phase rc=$rc $(( $(date +%s) - t0 ))s; tail: $(tail -n 1 "$log" 2>/dev/null)" | tee -a "$OUT/summary.log"
done
exit "$failed"
