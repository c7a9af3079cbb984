"""Data parallelism over a device mesh: the same step on every device, each on its slice of the batch.

jaxfox's kernels are batch-parallel (block per sample), so data parallelism needs no kernel support:
inside ``jax.shard_map`` every FFI call sees its device's local batch, and the parameter gradient of
a shard (reduced over the local rows by the deterministic ``reduce_axis0``) is combined across
devices with ``jax.lax.pmean``. Nothing of the batch is gathered: the only collectives are the
all-reduce of the loss and of the gradient (one value per parameter).

Reduction order: a gradient on N devices is ``(sum over devices of the local mean gradients) / N``.
It equals the one-device mean gradient up to float32 rounding, and for a fixed N (and device
order) it is bitwise reproducible, since the local reduction is deterministic and the all-reduce of
N values is done in a fixed order for a fixed topology.

Usage (a plain optax step)::

    mesh = jaxfox.sharding.batch_mesh()                  # all local devices, axis "batch"
    vg = jaxfox.sharding.data_parallel_value_and_grad(loss_fn, mesh)
    loss, grads = vg(params, x, y)                       # x, y [B, ...], B divisible by mesh size
"""

from __future__ import annotations

import numpy as np

import jax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

__all__ = ["batch_mesh", "batch_axis", "batch_sharding", "check_divisible", "data_parallel_value_and_grad",
           "reshard_args"]

AXIS = "batch"
"""The axis name of :func:`batch_mesh`'s meshes."""


def batch_mesh(devices=None, *, axis_name: str = AXIS) -> Mesh:
    """A one-axis mesh over ``devices`` (default: every local device of the default backend).

    Raises:
      ValueError: ``devices`` is empty.
    """
    devices = jax.local_devices() if devices is None else list(devices)
    if len(devices) == 0:
        raise ValueError("batch_mesh: devices must name at least one device, got none")
    return Mesh(np.array(devices), (axis_name,))


def batch_axis(mesh: Mesh, axis_name: str | None = None) -> str:
    """The mesh axis that the batch is split over.

    ``axis_name`` when given (it must be an axis of ``mesh``); otherwise the only axis of a one-axis mesh
    (whatever its name: ``"batch"``, ``"data"``, ...), or the axis named ``"batch"`` of a larger mesh.

    Raises:
      ValueError: ``axis_name`` is not an axis of ``mesh``, or it is None and ``mesh`` has several axes,
        none named ``"batch"``.
    """
    names = tuple(mesh.axis_names)
    if axis_name is not None:
        if axis_name not in names:
            raise ValueError(f"axis_name {axis_name!r} is not an axis of the mesh, whose axes are {names}")
        return axis_name
    if len(names) == 1:
        return names[0]
    if AXIS in names:
        return AXIS
    raise ValueError(f"mesh has axes {names}: name the one the batch is split over with axis_name=, or use a "
                     f"one-axis mesh (jaxfox.sharding.batch_mesh())")


def batch_sharding(mesh: Mesh, *, axis_name: str | None = None) -> NamedSharding:
    """Sharding of an array whose leading axis is the batch: split over the batch axis (:func:`batch_axis`),
    the rest whole."""
    return NamedSharding(mesh, P(batch_axis(mesh, axis_name)))


def check_divisible(name: str, batch: int, mesh: Mesh, *, axis_name: str | None = None) -> None:
    """Raises ValueError naming ``name`` when ``batch`` does not split evenly over the batch axis
    (:func:`batch_axis`, whose errors it raises too)."""
    axis_name = batch_axis(mesh, axis_name)
    n = mesh.shape[axis_name]
    if batch % n:
        raise ValueError(f"{name}: the batch axis ({batch}) must be divisible by the {n} devices of the mesh "
                         f"axis {axis_name!r}; pass a smaller mesh (jaxfox.sharding.batch_mesh(devices)) or "
                         "another batch size")


def reshard_args(mesh, args, specs) -> tuple:
    """Each argument (a pytree) laid out over ``mesh`` as its ``PartitionSpec`` says (``jax.reshard``).

    Needed before ``jax.shard_map`` on Explicit mesh axes, where an array's type carries its sharding and
    must match ``in_specs``.

    Raises:
      ValueError: ``args`` and ``specs`` have different lengths.
    """
    args, specs = tuple(args), tuple(specs)
    if len(args) != len(specs):
        raise ValueError(f"reshard_args: specs must have one PartitionSpec per argument ({len(args)}), "
                         f"got {len(specs)}")
    return tuple(jax.tree.map(lambda x, s=spec: jax.reshard(x, NamedSharding(mesh, s)), a)
                 for a, spec in zip(args, specs))


def data_parallel_value_and_grad(fun, mesh: Mesh | None = None, *, axis_name: str | None = None, batch_argnums=(1,),
                                 has_aux: bool = False):
    """Data-parallel ``jax.value_and_grad(fun)`` over the batch axis of a mesh.

    Args:
      fun: ``fun(params, *args) -> loss`` (or ``(loss, aux)`` with ``has_aux``), where ``loss`` is a
        float32 scalar that is a MEAN over the batch rows of the batch arguments. ``aux`` is a pytree of
        per-row arrays (leading axis = the local batch), returned concatenated over devices in batch order.
      mesh: the device mesh (default: :func:`batch_mesh`, all local devices).
      axis_name: the mesh axis the batch is split over (default: :func:`batch_axis`: the only axis of a
        one-axis mesh, else the axis named "batch"); the other axes of the mesh replicate the work.
      batch_argnums: positions (in ``fun``'s signature, params = 0) of the arguments whose every leaf
        has the batch as its leading axis; they are split over the devices. The other arguments, and
        ``params``, are replicated.
      has_aux: ``fun`` returns ``(loss, aux)``; every leaf of ``aux`` must have the local batch as its leading
        axis (a scalar leaf fails inside ``jax.shard_map``: reduce it to the loss or give it a batch axis).

    Returns:
      ``g(params, *args) -> (loss, grads)`` (``((loss, aux), grads)`` with ``has_aux``): the global mean
      loss and its gradient with respect to ``params`` (same pytree), replicated. Call it inside
      ``jax.jit``; each device runs ``fun`` on batch / N rows (see the module docstring for the reduction).

    Raises:
      ValueError: at trace time, when a batch argument's leading axis is not divisible by the number
        of devices on ``axis_name`` (the message names the argument) or ``batch_argnums`` names a position
        beyond the arguments passed; at once, when ``batch_argnums`` is empty, names params (0) or a negative
        position, or the mesh has no such axis (:func:`batch_axis`).
      TypeError: at once, when ``batch_argnums`` is not a tuple of ints (a bare int, a float or a bool).
    """
    mesh = batch_mesh(axis_name=axis_name or AXIS) if mesh is None else mesh
    axis_name = batch_axis(mesh, axis_name)
    given = batch_argnums
    try:
        batch_argnums = tuple(batch_argnums)
    except TypeError:
        batch_argnums = None
    if batch_argnums is None or not all(isinstance(i, (int, np.integer)) and not isinstance(i, (bool, np.bool_))
                                        for i in batch_argnums):
        raise TypeError(f"batch_argnums must be a tuple of ints (positions in fun's signature, params = 0), got "
                        f"{given!r}")
    batch_argnums = tuple(int(i) for i in batch_argnums)
    if 0 in batch_argnums:
        raise ValueError("batch_argnums: position 0 is params, which are replicated, not split")
    if not batch_argnums or min(batch_argnums) < 1:
        raise ValueError("batch_argnums must name at least one argument by its position >= 1 in fun's signature "
                         f"(params = 0; negative positions are not supported), got {batch_argnums}")

    def wrapped(params, *args):
        if max(batch_argnums) > len(args):
            raise ValueError(f"batch_argnums {batch_argnums} names position {max(batch_argnums)}, but the call "
                             f"passes only {len(args)} argument(s) after params (positions 1..{len(args)})")
        for i in batch_argnums:
            for path, leaf in jax.tree_util.tree_leaves_with_path(args[i - 1]):
                if np.ndim(leaf) == 0:
                    raise ValueError(f"argument {i}{jax.tree_util.keystr(path)}: a batch argument needs a leading "
                                     "batch axis, got a scalar")
                check_divisible(f"argument {i}{jax.tree_util.keystr(path)}", np.shape(leaf)[0], mesh,
                                axis_name=axis_name)

        def body(params, *args):
            # A per-device (varying) copy of the params: value_and_grad then gives this shard's gradient,
            # which is averaged explicitly (pmean) in one all-reduce per leaf.
            pv = jax.lax.pcast(params, axis_name, to="varying")
            out, grads = jax.value_and_grad(fun, has_aux=has_aux)(pv, *args)
            grads = jax.lax.pmean(grads, axis_name)
            if has_aux:
                loss, aux = out
                return (jax.lax.pmean(loss, axis_name), aux), grads
            return jax.lax.pmean(out, axis_name), grads

        in_specs = (P(),) + tuple(P(axis_name) if (i + 1) in batch_argnums else P() for i in range(len(args)))
        out_specs = ((P(), P(axis_name)), P()) if has_aux else (P(), P())
        if any(t == AxisType.Explicit for t in mesh.axis_types):
            # Explicit axes (jax.make_mesh's default) type every array with its sharding, and shard_map
            # insists that it matches in_specs: lay the inputs out as the specs say first.
            params, *args = reshard_args(mesh, (params, *args), in_specs)
        return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs)(params, *args)

    return wrapped
