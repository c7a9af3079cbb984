#!/usr/bin/env bash
# The README's test command. Sets up .venv (scripts/setup.sh) with the test extras, checks that
# the CUDA extension was built when a CUDA compiler is present, and runs the whole suite.
# GPU tests (marker `gpu`) run where a CUDA device and the kernels are present, else they skip.
set -euo pipefail
cd "$(dirname "$0")/.."
JAXFOX_EXTRAS=test source scripts/setup.sh
if command -v nvcc >/dev/null 2>&1 || [ -n "${CUDACXX:-}" ]; then
  (cd /tmp && python -c "import jaxfox._jaxfox_cuda as m; print('jaxfox: CUDA extension built, XLA FFI API', m.ffi_api_version)")
fi
python -m ipykernel install --user --name python3 >/dev/null
# `pytest` (not `python -m pytest`) so that the installed package, not ./jaxfox, is imported.
exec pytest -q -ra "$@"
