"""Loading and registering the CUDA extension, and choosing the kernel or the reference path.

The extension ``jaxfox._jaxfox_cuda`` is loaded once, on first use. Every handler it exports is
registered with XLA for the CUDA platform. Ops call :func:`dispatch`, which uses
``jax.lax.platform_dependent`` so that one traced function runs the kernels when compiled for a GPU
and the pure-JAX reference anywhere else.

Kernel use is decided when a function is *traced*. :func:`use_reference` is a JAX configuration
state that is part of JAX's trace context and jit cache key (like ``jax.default_matmul_precision``),
so calling an already-jitted function inside it traces it again with the reference path, and
traced ``lax.scan``/``fori_loop`` bodies are not reused across the two modes.
``JAXFOX_DISABLE_KERNELS=1`` (read when a function is traced) forces the reference path for the process.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import threading
import warnings

import jax

__all__ = ["kernels_available", "kernels_unavailable_reason", "use_reference", "dispatch", "ffi_call", "psum_to_match",
           "kernel_opted_in", "OPT_IN"]


def _make_reference_state():
    """A thread-local JAX config state included in the jit key and trace context.

    Uses ``jax._src.config.bool_state``, the mechanism behind ``jax.default_matmul_precision``.
    Should that internal API change, falls back to a plain thread-local flag (then a function
    jitted outside ``use_reference()`` keeps its kernels inside it: jit it anew there).
    """
    try:
        from jax._src import config as jax_config

        return jax_config.bool_state(
            name="jaxfox_use_reference", default=False,
            help="Trace jaxfox ops with their pure-JAX reference implementations instead of the CUDA kernels.",
            include_in_jit_key=True, include_in_trace_context=True)
    except Exception:  # pragma: no cover - depends on JAX internals
        return None


_reference_state = _make_reference_state()
_local = threading.local()


def _reference_forced() -> bool:
    if _reference_state is not None:
        return bool(_reference_state.value)
    return bool(getattr(_local, "reference", 0))


_registered: set[str] = set()  # the FFI targets _load registered


def has_target(name: str) -> bool:
    """Whether the built extension registered FFI target ``name`` (targets of sm_90a-only kernels exist only in
    builds with sm_90a machine code: ffi/targets.h JAXFOX_SM90A_TARGETS)."""
    return _load()[0] and name in _registered


@functools.cache
def _load() -> tuple[bool, str | None]:
    """Imports the extension and registers its FFI targets. Returns (ok, reason-if-not)."""
    try:
        from jaxfox import _jaxfox_cuda  # type: ignore[attr-defined]
    except ImportError as e:
        return False, f"the CUDA extension jaxfox._jaxfox_cuda is not built ({e}); reference path only"
    built_api = tuple(_jaxfox_cuda.ffi_api_version)
    try:
        for name, capsule in _jaxfox_cuda.targets().items():
            jax.ffi.register_ffi_target(name, capsule, platform="CUDA")
            _registered.add(name)
    except Exception as e:  # registration failures name the versions involved
        import jaxlib

        return False, (
            f"registering jaxfox's FFI targets failed ({e}); the extension was built against XLA FFI API "
            f"{built_api[0]}.{built_api[1]} and this runtime is jaxlib {jaxlib.__version__}. "
            "Rebuild jaxfox against the oldest jaxlib you run (see pyproject.toml)."
        )
    return True, None


def _has_cuda_backend() -> bool:
    try:
        return len(jax.devices("cuda")) > 0
    except RuntimeError:
        return False


@functools.cache
def cuda_compute_capability() -> tuple[int, int] | None:
    """Lowest compute capability among the local CUDA devices (None without any)."""
    try:
        caps = [tuple(int(v) for v in str(d.compute_capability).split(".")[:2]) for d in jax.devices("cuda")]
    except (RuntimeError, AttributeError, ValueError):
        return None
    return min(caps) if caps else None


def smem_per_block_limit(cc: tuple[int, int] | None) -> int:
    """Opt-in dynamic shared memory per block (bytes) of compute capability ``cc`` (CUDA programming guide,
    "Technical specifications"): 8.0 / 8.7: 163 KiB; 9.0, 10.x: 227 KiB; the others of 8.x and 12.x: 99 KiB.
    ``cc`` None (``cuda_compute_capability()`` without a CUDA device, e.g. tracing for CUDA elsewhere): 9.0's."""
    if cc is None or cc[0] in (9, 10):
        return 227 * 1024
    if cc in ((8, 0), (8, 7)):
        return 163 * 1024
    return 99 * 1024


def kernels_unavailable_reason() -> str | None:
    """Why the CUDA kernels are not used on this machine right now, or None when they are."""
    if os.environ.get("JAXFOX_DISABLE_KERNELS", "0") not in ("", "0"):
        return "JAXFOX_DISABLE_KERNELS is set"
    if _reference_forced():
        return "inside jaxfox.use_reference()"
    ok, reason = _load()
    if not ok:
        return reason
    if not _has_cuda_backend():
        return "no CUDA device is visible to JAX; reference path only"
    return None


OPT_IN_ENV = "JAXFOX_OPT_IN_KERNELS"
OPT_IN = ("attention_pool", "grouped_matmul", "adamw", "grn", "iql")
"""Ops whose kernels are slower than XLA on the H200 so far (BENCHMARKS.md), or slower at some sizes: they run the
reference there unless named in ``JAXFOX_OPT_IN_KERNELS`` (comma-separated, or ``all``), read when a function is
traced. (``adamw``: its kernel runs by default on parameter trees of many small leaves, :func:`jaxfox.fused_adamw`;
the opt-in extends it to one flat buffer and big leaves. ``attention_pool``: its kernels; by default XLA runs the same
factored form, which was faster. ``grn``: the single-GRN kernels of ``ffi/grn.cu``, also used by
the VSN's selection GRN. ``iql``: the kernel path of :func:`jaxfox.iql_value_loss` runs by default for hidden widths
H >= 128; the opt-in extends it to smaller H.)"""


def opted_in_names() -> set[str]:
    """The names listed in ``JAXFOX_OPT_IN_KERNELS`` now (comma-separated, blanks ignored)."""
    return {n.strip() for n in os.environ.get(OPT_IN_ENV, "").split(",") if n.strip()}


_warned_unknown: set[frozenset] = set()


def kernel_opted_in(op: str) -> bool:
    """True when the opt-in kernel of ``op`` (one of :data:`OPT_IN`) is requested by ``JAXFOX_OPT_IN_KERNELS``.

    Names in ``JAXFOX_OPT_IN_KERNELS`` that are neither in :data:`OPT_IN` nor ``all`` (a misspelling, or an op whose
    kernel now runs by default) are ignored with a ``UserWarning`` naming them, once per distinct set.
    """
    if op not in OPT_IN:
        raise ValueError(f"kernel_opted_in: op must be one of {OPT_IN}, got {op!r}")
    names = opted_in_names()
    unknown = frozenset(names - set(OPT_IN) - {"all"})
    if unknown and unknown not in _warned_unknown:
        _warned_unknown.add(unknown)
        warnings.warn(f"{OPT_IN_ENV} names {sorted(unknown)}, which are not opt-in kernels (ignored); the opt-in "
                      f"names are {list(OPT_IN)} and 'all'", UserWarning, stacklevel=2)
    return op in names or "all" in names


def kernels_available() -> bool:
    """True when jaxfox ops traced now will run their CUDA kernels on GPU inputs.

    The reason when False is given by :func:`kernels_unavailable_reason`.
    """
    return kernels_unavailable_reason() is None


@contextlib.contextmanager
def use_reference():
    """Context manager: jaxfox ops traced inside it use the pure-JAX reference path (A/B tests, debugging).

    Part of JAX's jit cache key, so ``f = jax.jit(g)`` called inside and outside the context runs
    the reference and the kernel path respectively.
    """
    if _reference_state is not None:
        with _reference_state(True):
            yield
        return
    _local.reference = getattr(_local, "reference", 0) + 1
    try:
        yield
    finally:
        _local.reference -= 1


def _varying_axes(x) -> frozenset:
    """The manual mesh axes over which ``x``'s value varies (its type's "vma"; empty outside shard_map)."""
    aval = jax.typeof(x)
    mat = getattr(aval, "mat", None)  # jax 0.11: ShapedArray.mat.varying
    if mat is not None and hasattr(mat, "varying"):
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", None) or ())  # older spelling


def ffi_call(target_name, result_shape_dtypes, **kwargs):
    """``jax.ffi.ffi_call`` whose results are typed as varying over the mesh axes its operands vary over.

    Inside ``jax.shard_map`` (with ``check_vma``), JAX's ``ffi_call`` (0.11) types its results as
    device-invariant whatever its operands, so they would not match the reference path's types (or the
    cotangent types of a ``custom_vjp``); this casts them (``jax.lax.pcast(..., to="varying")``, no data
    movement) to the union of the operands' varying axes. Outside shard_map it is ``jax.ffi.ffi_call``.
    """
    call = jax.ffi.ffi_call(target_name, result_shape_dtypes, **kwargs)

    def wrapped(*args, **attrs):
        vma = frozenset().union(*(_varying_axes(a) for a in jax.tree.leaves(args)))
        out = call(*args, **attrs)
        if not vma:
            return out

        def cast(o):
            missing = tuple(sorted(vma - _varying_axes(o)))
            return jax.lax.pcast(o, missing, to="varying") if missing else o

        return jax.tree.map(cast, out)

    return wrapped


def psum_to_match(cts, primals):
    """Cotangents of a ``custom_vjp`` over FFI calls, summed over the mesh axes along which they vary but
    their primal inputs do not (inside ``jax.shard_map``; the identity elsewhere).

    A replicated (device-invariant) input used by every device's rows, such as the parameters, gets one
    partial cotangent per device from the backward kernel; its cotangent is their sum (``jax.lax.psum``,
    the transpose of the implicit broadcast). ``cts`` and ``primals`` are matching tuples; None and
    integer entries are passed through.
    """
    out = []
    for ct, primal in zip(cts, primals):
        if ct is not None and primal is not None:
            extra = tuple(sorted(_varying_axes(ct) - _varying_axes(primal)))
            if extra:
                ct = jax.lax.psum(ct, extra)
        out.append(ct)
    return tuple(out)


def _batch_dims(batch):
    """``batch`` entries as the axis of the batch in each argument, or None (replicated): True is axis 0."""
    return [None if b is None or b is False else (0 if b is True else int(b)) for b in batch]


def _split_axes(leaf):
    """The mesh of ``leaf``'s type sharding (``jax.typeof(x).sharding``, which carries one only for meshes with
    Explicit axes, ``jax.make_mesh``'s default) and, per dimension of its spec, the mesh axes splitting it with
    their types ``((name, AxisType), ...)``; ``(None, [])`` without a mesh."""
    sharding = getattr(jax.typeof(leaf), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or mesh.empty:
        return None, []
    types = dict(zip(mesh.axis_names, mesh.axis_types))
    dims = []
    for entry in sharding.spec:
        axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        dims.append(tuple((a, types.get(a)) for a in axes))
    return mesh, dims


def _explicit_batch_axes(args, batch):
    """The explicit mesh axes that split the batch axis of the ``batch`` args, or None.

    Read from the arguments' types (:func:`_split_axes`); the first batch leaf whose batch axis is split over
    Explicit axes only wins.
    """
    from jax.sharding import AxisType

    for arg, d in zip(args, _batch_dims(batch)):
        if d is None:
            continue
        for leaf in jax.tree.leaves(arg):
            mesh, dims = _split_axes(leaf)
            if len(dims) > d and dims[d] and all(t == AxisType.Explicit for _, t in dims[d]):
                return mesh, tuple(a for a, _ in dims[d])
    return None


def explicitly_split(*trees) -> bool:
    """True when a leaf of ``trees`` is split along any axis over an Explicit mesh axis (its type's sharding,
    :func:`_split_axes`). For ops whose kernel path is for one device and not batch-parallel (a loss that is a
    mean over the batch), which then run their reference."""
    from jax.sharding import AxisType

    return any(t == AxisType.Explicit for leaf in jax.tree.leaves(trees) for axes in _split_axes(leaf)[1]
               for _, t in axes)


def _only_batch_split(args, dims, mesh, axes) -> bool:
    """True when every batch leaf's batch axis divides over ``axes`` and no batch leaf is split along another
    axis (then each device's rows are a shard_map block; else XLA must partition the op: the reference)."""
    n = math.prod(mesh.shape[a] for a in axes)
    for arg, d in zip(args, dims):
        if d is None:
            continue  # replicated arguments are gathered whole onto each device
        for leaf in jax.tree.leaves(arg):
            spec = tuple(getattr(getattr(jax.typeof(leaf), "sharding", None), "spec", ()) or ())
            if leaf.shape[d] % n or any(e is not None and j != d for j, e in enumerate(spec)):
                return False
    return True


def dispatch(kernel_fn, reference_fn, *args, batch=None, out_batch=0):
    """``kernel_fn(*args)`` when compiled for CUDA with kernels available, else ``reference_fn(*args)``.

    Both must return the same pytree of shapes and dtypes.

    ``batch`` (batch-parallel ops): one entry per argument, True (or an int axis) where every leaf has the
    batch on its leading axis (or on that axis), False/None where the argument is replicated (parameters);
    every output then has the batch on axis ``out_batch``. When the batch arguments are split over Explicit
    mesh axes (``jax.make_mesh`` / ``jax.set_mesh`` sharding-in-types), the op runs under ``jax.shard_map``
    over those axes: each device computes its own rows with the kernels (nothing of the batch is gathered;
    the replicated arguments are whole on each device), and the gradients of the replicated arguments are
    summed over the devices by shard_map's transpose (one all-reduce). A batch that does not divide over
    those axes, or a batch argument also split along another axis, runs the reference, which XLA
    partitions. Under Auto axes, wrap the step in ``jax.shard_map`` yourself (:mod:`jaxfox.sharding`).
    """
    def run(*a):
        if not kernels_available():
            return reference_fn(*a)
        return jax.lax.platform_dependent(*a, cuda=kernel_fn, default=reference_fn)

    found = _explicit_batch_axes(args, batch) if batch is not None else None
    if found is None:
        return run(*args)
    from jax.sharding import PartitionSpec

    from jaxfox.sharding import reshard_args  # sharding imports no jaxfox module: no cycle

    mesh, axes = found
    dims = _batch_dims(batch)
    if not _only_batch_split(args, dims, mesh, axes):
        return reference_fn(*args)
    in_specs = tuple(PartitionSpec() if d is None else PartitionSpec(*([None] * d), axes) for d in dims)
    split = PartitionSpec(*([None] * out_batch), axes)
    # every batch leaf split over the same axes, every other argument whole on each device
    args = reshard_args(mesh, args, in_specs)
    # check_vma=False: FFI calls do not type their results as device-varying; shard_map's transpose then
    # sums the cotangents of the replicated arguments over the axes explicitly (one psum each).
    return jax.shard_map(run, mesh=mesh, in_specs=in_specs, out_specs=split, axis_names=set(axes),
                         check_vma=False)(*args)
