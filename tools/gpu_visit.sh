#!/usr/bin/env bash
# One visit to the lent GPU machine (no network there): build jaxfox in place, then run the phases named
# on the command line, and stop starting new steps once the budget (seconds, JAXFOX_VISIT_BUDGET, default
# 540: a device command may run 600 s) is spent.
#
#   bash tools/gpu_visit.sh build test:optim sanitize:optim bench:adamw,copy
#
# Phases: build (sm_90a only, all cores) | test:<module,...> (tests/test_gpu_<module>.py under `pytest -m gpu`;
#         a module may be `cfc::test_name` to run one test) | ptest:<module>:<n> (the same for one module, split over
#         n pytest processes run at once: JAXFOX_TEST_SHARD, tests/conftest.py; their logs go into visit.log) |
#         sanitize:<name,...> (memcheck, then racecheck, of tests/gpu_sanitize_<name>.py; `sanitize:` alone
#         is tests/gpu_sanitize.py) | bench:<op,...> (python -m jaxfox.bench --ops ... --repeats 3) |
#         job:<epochs> (the main job, examples/train_perception.py, with kernels, then JAXFOX_DISABLE_KERNELS=1;
#         needs the arch wheel in .whl).
# Output (the device tool returns at most 8 files): $OUT/visit.log (every phase's output, one after the
# other), $OUT/summary.log (one line per phase), $OUT/bench_<ops>.json per bench phase and the job's two
# metrics.json files (job_kernels_metrics.json, job_ref_metrics.json: full-precision epoch times).
# Wheels that the machine lacks (arch, ...) travel in .whl (see the device tool's README) and are installed
# first when that folder exists. Every phase runs even when an earlier one failed; the exit code is the
# number of failed or skipped phases (a phase whose tests all skip counts as failed: pytest exits 5).
set -u
cd "$(dirname "$0")/.."
repo="$PWD"
OUT="$(mkdir -p "${OUT:-/tmp/jaxfox-visit}" && cd "${OUT:-/tmp/jaxfox-visit}" && pwd)"
budget="${JAXFOX_VISIT_BUDGET:-540}"
start=$(date +%s)
log="$OUT/visit.log"
summary="$OUT/summary.log"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
left() { echo $(( budget - ($(date +%s) - start) )); }
note() { echo "$*" | tee -a "$summary"; }
if [ -d .whl ]; then
  if python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      >>"$log" 2>&1; then
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  else
    note "wheels in .whl did not install (see visit.log)"
  fi
fi
failed=0
for phase in "$@"; do
  if [ "$(left)" -le 20 ]; then note "SKIPPED $phase (budget spent)"; failed=$((failed + 1)); continue; fi
  name="${phase%%:*}"; arg="${phase#*:}"; [ "$arg" = "$phase" ] && arg=""
  echo "===== $phase" >>"$log"
  l0=$(wc -l <"$log")
  t0=$(date +%s)
  case "$name" in
    build)
      CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" CMAKE_ARGS="-DCMAKE_CUDA_ARCHITECTURES=90a-real" \
        timeout "$(left)" python3 -m pip install --no-build-isolation --no-deps -e . >>"$log" 2>&1 \
        && (cd /tmp && python3 -c "import jaxfox; assert jaxfox.kernels_available(), jaxfox.kernels_unavailable_reason(); print('kernels available')") >>"$log" 2>&1 ;;
    test)
      files=(); for m in ${arg//,/ }; do
        case "$m" in *::*) files+=("$repo/tests/test_gpu_${m%%::*}.py::${m#*::}") ;; *) files+=("$repo/tests/test_gpu_${m}.py") ;; esac
      done
      (cd /tmp && timeout "$(left)" python3 -m pytest -q -rfE -m gpu -p no:cacheprovider --rootdir "$repo" "${files[@]}") >>"$log" 2>&1 ;;
    ptest)
      m="${arg%%:*}"; n="${arg#*:}"; [ "$n" = "$arg" ] && n=4
      pids=()
      for ((i = 0; i < n; i++)); do
        (cd /tmp && JAXFOX_TEST_SHARD="$i/$n" XLA_PYTHON_CLIENT_PREALLOCATE=false timeout "$(left)" python3 -m pytest -q -rfE -m gpu \
          -p no:cacheprovider --rootdir "$repo" "$repo/tests/test_gpu_$m.py" >"/tmp/ptest_${m}_$i.log" 2>&1) &
        pids+=($!)
      done
      rc=0; for p in "${pids[@]}"; do wait "$p" || rc=1; done
      for ((i = 0; i < n; i++)); do echo "-- shard $i/$n" >>"$log"; cat "/tmp/ptest_${m}_$i.log" >>"$log"; done
      [ "$rc" = 0 ] ;;
    sanitize)
      rc=0
      for s in ${arg:-_}; do
        for s1 in ${s//,/ }; do
          script="tests/gpu_sanitize_$s1.py"; [ "$s1" = "_" ] && script="tests/gpu_sanitize.py"
          for tool in memcheck racecheck; do
            t=$(left)
            if [ "$t" -le 20 ]; then echo "== $tool $script: SKIPPED (budget spent)" >>"$log"; rc=1; continue; fi
            echo "== $tool $script" >>"$log"
            # JAXFOX_SANITIZE_ARGS: extra compute-sanitizer options; unset = "--kernel-name kns=jaxfox": only the
            # kernels whose mangled name contains "jaxfox" (every kernel of ffi/, namespace jaxfox) are instrumented,
            # not XLA's GEMMs (the sanitizer crashed at start-up on scripts whose programs have cuBLAS / wgmma
            # kernels; the same run with a kernel-name filter, started by hand, completed). "" = no filter.
            # A front end that dies on a signal (compute-sanitizer segfaulted at start-up on gpu_sanitize_vsn.py once
            # while racecheck of the same script ran clean) leaves its python target running, which then wrote into
            # the next run's log: kill what is left of the target after each run, and try a crashed run once more.
            for attempt in 1 2; do
              # shellcheck disable=SC2086
              (cd /tmp && timeout "$(left)" compute-sanitizer --tool "$tool" ${JAXFOX_SANITIZE_ARGS---kernel-name kns=jaxfox} \
                --error-exitcode 3 \
                python3 "$repo/$script") >>"$log" 2>&1
              src=$?
              pkill -KILL -f "python3 $repo/$script" 2>/dev/null
              if [ "$src" -gt 128 ] && [ "$src" != 137 ] && [ "$attempt" = 1 ] && [ "$(left)" -gt 20 ]; then
                echo "== $tool $script: compute-sanitizer died on signal $((src - 128)); once more" >>"$log"
                continue
              fi
              break
            done
            [ "$src" = 0 ] || rc=1
          done
        done
      done
      [ "$rc" = 0 ] ;;
    bench)
      (cd /tmp && timeout "$(left)" python3 -m jaxfox.bench --ops "$arg" --repeats 3 --json "$OUT/bench_${arg//,/_}.json") >>"$log" 2>&1 ;;
    job)
      (cd "$repo" && export TQDM_DISABLE=1 && timeout "$(left)" python3 examples/train_perception.py --epochs "${arg:-3}" --out /tmp/job-kernels \
        && JAXFOX_DISABLE_KERNELS=1 timeout "$(left)" python3 examples/train_perception.py --epochs "${arg:-3}" --out /tmp/job-ref) \
        >>"$log" 2>&1
      rc=$?
      for w in kernels ref; do [ -f "/tmp/job-$w/metrics.json" ] && cp "/tmp/job-$w/metrics.json" "$OUT/job_${w}_metrics.json"; done
      [ "$rc" = 0 ] ;;
    *) echo "unknown phase $phase" >>"$log"; false ;;
  esac
  rc=$?
  [ "$rc" = 0 ] || failed=$((failed + 1))
  note "$phase rc=$rc $(( $(date +%s) - t0 ))s; last line: $(tail -n 1 "$log")"
  # the names of failed tests (pytest -rfE), so that they reach summary.log when visit.log does not come back
  tail -n +"$((l0 + 1))" "$log" | grep -E "^(FAILED|ERROR) " | head -n 20 | cut -c1-300 >>"$summary"
done
exit "$failed"
