# Sourced by scripts/test.sh and scripts/train.sh: makes (once) and activates a Python >= 3.12
# virtual environment in .venv unless one is already active, and installs jaxfox into it with
# the extras named in $JAXFOX_EXTRAS. With nvcc on PATH (or CUDACXX set) the CUDA extension is
# compiled; without one the pure-JAX package is installed.
if [ -z "${VIRTUAL_ENV:-}" ]; then
  PY=""
  for cand in python3.12 python3.13 python3 "$HOME"/.pyenv/versions/3.1[2-9]*/bin/python; do
    if command -v "$cand" >/dev/null 2>&1 && "$cand" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
      PY="$cand"; break
    fi
  done
  [ -n "$PY" ] || { echo "jaxfox needs Python >= 3.12 (none found on PATH or under ~/.pyenv)" >&2; exit 1; }
  [ -x .venv/bin/python ] || "$PY" -m venv .venv
  # shellcheck disable=SC1091
  source .venv/bin/activate
  python -m pip install -q --upgrade pip
fi
if [ -z "${CUDACXX:-}" ] && ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then
  export CUDACXX=/usr/local/cuda/bin/nvcc
fi
python -m pip install -q ".${JAXFOX_EXTRAS:+[$JAXFOX_EXTRAS]}"
