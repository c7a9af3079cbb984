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
# Install only when the sources or the compiler changed since the last install into this environment,
# or an extra is asked for that it lacks (a fingerprint kept in the venv): with nvcc present an install
# compiles the CUDA extension, which takes a few minutes.
_jaxfox_fingerprint() {
  {
    echo "nvcc=$(command -v nvcc || echo "${CUDACXX:-none}")"
    find pyproject.toml CMakeLists.txt ffi jaxfox -type f ! -path '*/__pycache__/*' ! -name '*.so' -print0 \
      | sort -z | xargs -0 sha1sum
  } | sha1sum | cut -d' ' -f1
}
_JAXFOX_STAMP="$(python -c 'import sys; print(sys.prefix)')/.jaxfox-install-stamp"
_JAXFOX_FP="$(_jaxfox_fingerprint)"
_jaxfox_have="" _jaxfox_skip=""
if [ "$(head -n1 "$_JAXFOX_STAMP" 2>/dev/null)" = "$_JAXFOX_FP" ] \
    && python -c 'import importlib.metadata as m; m.version("jaxfox")' >/dev/null 2>&1; then
  _jaxfox_have="$(sed -n 2p "$_JAXFOX_STAMP")"
  _jaxfox_skip=1
  for _x in ${JAXFOX_EXTRAS:+${JAXFOX_EXTRAS//,/ }}; do
    case ",$_jaxfox_have," in *",$_x,"*) ;; *) _jaxfox_skip="";; esac
  done
fi
if [ -z "$_jaxfox_skip" ]; then
  _jaxfox_extras="$(printf '%s\n' ${_jaxfox_have:+${_jaxfox_have//,/ }} ${JAXFOX_EXTRAS:+${JAXFOX_EXTRAS//,/ }} \
    | sed '/^$/d' | sort -u | paste -sd, -)"
  if command -v nvcc >/dev/null 2>&1 || [ -n "${CUDACXX:-}" ]; then
    echo "installing jaxfox and compiling its CUDA extension (a few minutes; later runs skip this) ..." >&2
  else
    echo "installing jaxfox (no CUDA compiler: the pure-JAX package) ..." >&2
  fi
  python -m pip install -q ".${_jaxfox_extras:+[$_jaxfox_extras]}"
  printf '%s\n%s\n' "$_JAXFOX_FP" "$_jaxfox_extras" > "$_JAXFOX_STAMP"
fi
unset _jaxfox_skip _jaxfox_have _jaxfox_extras _x
