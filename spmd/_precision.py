"""Mixed precision as plan data: the dtypes a step stores, computes, gathers and reduces in, and the one cast
that applies them to any model's parameter tree (as jmp does), whatever executor runs the step.

The stored parameters and the optimizer state keep ``params`` (fp32 master weights). Each step casts the float
leaves to ``gather`` on each device's own shard, before any FSDP all-gather, so the gathered bytes are the
narrow ones; then to ``compute`` for the model. The gradients come back in the compute dtype and reach the
optimizer in ``params``. ``reduce`` is the dtype of the one reduction per step that gradient accumulation makes
(:mod:`spmd._accumulate`: the float32 accumulator is cast to it before it leaves the device). Without
accumulation, under SPMD annotations the compiler reduces each gradient at the matmul that makes it, in that
matmul's dtype, so a model computing in bf16 reduces in bf16 (the report reads the dtype the compiled reductions
carry, the cost model prices it). :func:`master_weights` is ZeRO's arrangement instead: narrow stored
parameters and the fp32 master in the optimizer state.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.extend.core import subjaxprs

from spmd._rules import PlanError, PlanWarning, user_stacklevel

__all__ = ["MasterState", "Precision", "cast_params", "check_compute", "master_weights", "to_stored_dtype"]


def _float_name(value: Any, field: str) -> str:
    """The canonical name of a floating dtype (``"bfloat16"``), or a PlanError naming the field and the value."""
    try:
        dtype = np.dtype(jnp.dtype(value))
    except (TypeError, ValueError):
        dtype = None
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        raise PlanError(
            f"spmd.Precision: {field}={value!r} is not a floating dtype; give a name such as 'bfloat16', "
            f"'float16' or 'float32'"
        ) from None
    return dtype.name


@dataclasses.dataclass(frozen=True)
class Precision:
    """A mixed-precision policy: ``compute`` (the model's parameters and activations), ``params`` (stored
    master weights and optimizer state), ``gather`` (what FSDP all-gathers move; default ``compute``) and
    ``reduce`` (the gradients' reduction: see the module doc). Names or dtypes; kept as canonical names.

    >>> p = Precision()
    >>> p.compute, p.params, p.gather, p.reduce
    ('bfloat16', 'float32', 'bfloat16', 'float32')
    >>> p.describe()
    'mixed precision: compute bfloat16, params float32, gather bfloat16, reduce float32'
    >>> try:
    ...     Precision(compute="int8")
    ... except PlanError as e:
    ...     print(e)  # doctest: +ELLIPSIS
    spmd.Precision: compute='int8' is not a floating dtype; give a name such as 'bfloat16', ...
    """

    compute: str = "bfloat16"
    params: str = "float32"
    gather: str | None = None
    reduce: str = "float32"

    def __post_init__(self) -> None:
        for field in ("compute", "params", "reduce"):
            object.__setattr__(self, field, _float_name(getattr(self, field), field))
        gather = self.compute if self.gather is None else _float_name(self.gather, "gather")
        object.__setattr__(self, "gather", gather)

    def itemsize(self, field: str) -> int:
        """Bytes per element of one of the policy's dtypes.

        >>> Precision().itemsize("gather"), Precision().itemsize("params")
        (2, 4)
        """
        return np.dtype(jnp.dtype(getattr(self, field))).itemsize

    def describe(self) -> str:
        """One line naming the four dtypes (see the class example)."""
        return (
            f"mixed precision: compute {self.compute}, params {self.params}, gather {self.gather}, reduce {self.reduce}"
        )

    def __str__(self) -> str:
        return self.describe()


def _cast(x: jax.Array, sharding: Any, precision: Precision) -> jax.Array:
    """One float leaf, narrowed on its own shard (constrained to its stored layout first)."""
    narrow = x if sharding is None else jax.lax.with_sharding_constraint(x, sharding)
    return narrow.astype(precision.gather).astype(precision.compute)


def cast_params(tree: Any, precision: Precision | None, shardings: Any = None) -> Any:
    """``tree`` with its float leaves cast for computing under ``precision`` (None: the tree itself). Each cast
    leaf is first constrained to its stored layout (``shardings``: a sharding or PartitionSpec per leaf, as
    the plan stores the parameters; None: no constraint), so the narrowing happens on each device's shard
    before any all-gather. Integer leaves and keys are left as they are; so is a leaf already in ``compute``.

    >>> import jax.numpy as jnp
    >>> tree = {"w": jnp.ones(2), "n": jnp.arange(2)}
    >>> {k: str(v.dtype) for k, v in cast_params(tree, Precision()).items()}
    {'n': 'int32', 'w': 'bfloat16'}
    >>> g = jax.grad(lambda t: cast_params(t, Precision())["w"].sum())({"w": jnp.ones(2)})
    >>> str(g["w"].dtype)  # gradients reach the stored leaves in the stored dtype
    'float32'
    """
    if precision is None:
        return tree

    def one(x: Any, sharding: Any = None) -> Any:
        dtype = getattr(x, "dtype", None)
        if dtype is None or not jnp.issubdtype(dtype, jnp.floating) or dtype == jnp.dtype(precision.compute):
            return x
        return _cast(x, sharding, precision)

    if shardings is None:
        return jax.tree.map(one, tree)
    return jax.tree.map(one, tree, shardings)


def to_stored_dtype(tree: Any, precision: Precision | None) -> Any:
    """``tree`` (arrays or ShapeDtypeStructs, flax boxes kept) with its float leaves in ``precision.params``: how
    the step stores parameters the model creates in another dtype (None: the tree itself).

    >>> out = to_stored_dtype({"w": jax.ShapeDtypeStruct((2,), "float32")}, Precision(params="bfloat16"))
    >>> str(out["w"].dtype)
    'bfloat16'
    """
    if precision is None:
        return tree

    def one(x: Any) -> Any:
        dtype = getattr(x, "dtype", None)
        if dtype is None or not jnp.issubdtype(dtype, jnp.floating) or dtype == jnp.dtype(precision.params):
            return x
        if isinstance(x, jax.ShapeDtypeStruct):
            return x.update(dtype=jnp.dtype(precision.params))
        return x.astype(precision.params)

    return jax.tree.map(one, tree)


class MasterState(NamedTuple):
    """The state of :func:`master_weights`: the master copy of the parameters and the inner optimizer's state.

    >>> MasterState({"w": 1.0}, ()).master
    {'w': 1.0}
    """

    master: Any
    inner: Any


def _widen(tree: Any, dtype: str) -> Any:
    floating = lambda x: jnp.issubdtype(jnp.result_type(x), jnp.floating)  # noqa: E731
    return jax.tree.map(lambda x: jnp.asarray(x).astype(dtype) if floating(x) else x, tree)


def master_weights(inner: optax.GradientTransformation, dtype: Any = "float32") -> optax.GradientTransformation:
    """``inner`` run on a ``dtype`` master copy of narrow stored parameters, the copy kept in the optimizer state:
    ZeRO's mixed precision, where the stored parameters are the bf16 ones the model reads and the fp32 master
    belongs to the optimizer state (so ZeRO-1/2 split it with the moments). Use it with
    ``Precision(params="bfloat16")``. Each update takes the stored parameters to the updated master rounded to
    their dtype, exactly (the update is given in ``dtype``).

    >>> import jax.numpy as jnp, optax
    >>> opt = master_weights(optax.sgd(1e-3))
    >>> params = {"w": jnp.ones(2, jnp.bfloat16)}
    >>> state = opt.init(params)
    >>> for _ in range(4):  # 1e-3 steps: each below bf16's spacing at 1.0, kept by the fp32 master
    ...     updates, state = opt.update({"w": jnp.ones(2, jnp.bfloat16)}, state, params)
    ...     params = optax.apply_updates(params, updates)
    >>> params["w"].dtype, round(float(state.master["w"][0]), 6), float(params["w"][0])
    (dtype(bfloat16), 0.996, 0.99609375)
    """
    dtype = _float_name(dtype, "dtype")

    def init(params: Any) -> MasterState:
        master = _widen(params, dtype)
        return MasterState(master, inner.init(master))

    def update(grads: Any, state: MasterState, params: Any = None) -> tuple[Any, MasterState]:
        if params is None:
            raise ValueError("master_weights: update needs params= (the stored parameters), as optax.adamw does")
        updates, inner_state = inner.update(_widen(grads, dtype), state.inner, state.master)
        master = optax.apply_updates(state.master, updates)
        # In ``dtype``: stored + (rounded master - stored) is then the rounded master exactly.
        step = jax.tree.map(lambda m, p: m.astype(p.dtype).astype(dtype) - p.astype(dtype), master, params)
        return step, MasterState(master, inner_state)

    return optax.GradientTransformation(init, update)


def _matmul_dtypes(jaxpr: Any) -> set[str]:
    """The operand dtypes of every matmul (``dot_general``) in a (closed) jaxpr and the jaxprs nested in it."""
    inner = jaxpr.jaxpr if hasattr(jaxpr, "jaxpr") else jaxpr
    out = {str(v.aval.dtype) for e in inner.eqns if e.primitive.name == "dot_general" for v in e.invars}
    for sub in subjaxprs(inner):
        out |= _matmul_dtypes(sub)
    return out


def check_compute(precision: Precision | None, jaxpr: Any) -> None:
    """Warns when a step under ``precision`` runs no matmul in its compute dtype: the model casts the narrow
    parameters back (flax's ``Dense(dtype=jnp.float32)`` promotes them), so the gathers shrink and the matmuls
    do not. Said, not silently carried out as something else.

    >>> import jax, jax.numpy as jnp, warnings
    >>> f32 = jax.make_jaxpr(lambda w: w.astype(jnp.float32) @ jnp.ones((2, 2)))(jnp.ones((2, 2), jnp.bfloat16))
    >>> with warnings.catch_warnings(record=True) as seen:
    ...     warnings.simplefilter("always")
    ...     check_compute(Precision(), f32)
    >>> "computes every matmul in float32" in str(seen[0].message)
    True
    """
    if precision is None:
        return
    dtypes = _matmul_dtypes(jaxpr)
    if dtypes and precision.compute not in dtypes:
        warnings.warn(
            f"mixed precision: the plan computes in {precision.compute}, and the model computes every matmul in "
            f"{', '.join(sorted(dtypes))}: its layers cast the {precision.compute} parameters back (flax's "
            f"Dense(dtype=jnp.float32) does). The gathers are narrow, the matmuls not; build the model with "
            f"dtype=jnp.{precision.compute} (or dtype=None)",
            PlanWarning,
            stacklevel=user_stacklevel(),
        )
