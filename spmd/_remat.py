"""Remat (activation checkpointing) policies as plan data: what a layer keeps for its backward pass.

A :class:`Remat` says which of a layer's activations survive from the forward to the backward pass; the rest
are recomputed there. ``none`` keeps everything (no remat); ``full`` keeps nothing but the layer's input (the
whole layer runs forward again); ``dots`` keeps every matmul output (only the cheap elementwise work runs again,
and, under FSDP, the gathered weights are not kept: the backward pass gathers them again); ``names`` keeps only
the activations tagged with those names (``jax.ad_checkpoint.checkpoint_name``); ``offload`` keeps them too,
moved to host memory (``pinned_host``) in the forward pass and back for the backward pass.

The built-in models tag their activations with :data:`NAMES` (MaxText's spelling). A user's layer takes the
active plan's policy through :func:`rematerialise`, or a given one through :meth:`Remat.wrap`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
from flax import linen as nn

from spmd._context import active
from spmd._rules import PlanError

__all__ = ["MATMUL_OUTPUTS", "NAMES", "Remat", "rematerialise"]

KINDS = ("none", "full", "dots", "names", "offload")
FORMS = "none, full, dots, names:a,b or offload:a,b"

# The activations the built-in GPTs tag, in a block's order: its input (the residual stream), the attention
# projections' outputs, attention's output before its out projection, the out projection's output, the MLP's
# hidden layer (``wi``'s output, before the GELU) and its output (``wo``'s).
NAMES = ("layer_input", "query_proj", "key_proj", "value_proj", "attn_out", "out_proj", "mlp_hidden", "mlp_out")
# Of those, the matmul outputs: what ``dots`` keeps on the device, and what the offload policy the command line's
# ``--offload activations`` asks for keeps on the host instead (PipeOffload's activations, MaxText's
# ``minimal_offloaded``): the same matmuls run, the kept activations leave the device.
MATMUL_OUTPUTS = NAMES[1:]


@dataclasses.dataclass(frozen=True)
class Remat:
    """A remat policy: ``kind`` (one of ``none``, ``full``, ``dots``, ``names``, ``offload``) and, for the last
    two, the activation ``names`` kept (on the device, or on the host). ``none`` is what a plan without a policy
    holds: merging a plan that has one with a plan that does not keeps the policy (see :meth:`merge`).

    >>> Remat("names", ("query_proj", "mlp_hidden")).describe()
    'layers rematerialised (saved: query_proj, mlp_hidden)'
    >>> bool(Remat()), bool(Remat("dots")), Remat("dots").recomputes_matmuls
    (False, True, False)
    """

    kind: str = "none"
    names: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise PlanError(f"spmd.Remat: unknown kind {self.kind!r}; the forms are {FORMS}")
        object.__setattr__(self, "names", tuple(self.names))
        if (self.kind in ("names", "offload")) != bool(self.names):
            raise PlanError(
                f"spmd.Remat: {self.kind!r} takes {'some' if self.kind in ('names', 'offload') else 'no'} activation "
                f"names, got {self.names!r}; e.g. Remat('names', ('mlp_hidden',)) (the built-in models tag "
                f"{', '.join(NAMES)})"
            )

    @classmethod
    def of(cls, value: Remat | str | bool | None) -> Remat:
        """A policy from a :class:`Remat`, a bool (``True``: ``full``, as plans said before policies) or a
        string (``none``, ``full``, ``dots``, ``names:a,b``, ``offload:a,b``).

        >>> Remat.of("offload:mlp_hidden,mlp_out"), Remat.of(True).kind
        (Remat(kind='offload', names=('mlp_hidden', 'mlp_out')), 'full')
        """
        if isinstance(value, Remat):
            return value
        if value is None or isinstance(value, bool):
            return cls("full" if value else "none")
        if not isinstance(value, str):
            raise PlanError(f"spmd.Remat: cannot read a policy from {value!r}; give one of {FORMS}")
        kind, colon, rest = value.partition(":")
        names = tuple(n.strip() for n in rest.split(",") if n.strip())
        if colon and not names:
            raise PlanError(f"spmd.Remat: {value!r} names no activation; the forms are {FORMS}")
        return cls(kind.strip(), names)

    @property
    def form(self) -> str:
        """The policy as :meth:`of` and ``--remat`` read it.

        >>> Remat("names", ("query_proj", "mlp_hidden")).form
        'names:query_proj,mlp_hidden'
        """
        return self.kind + (":" + ",".join(self.names) if self.names else "")

    def __bool__(self) -> bool:
        """Whether anything is rematerialised (every kind but ``none``)."""
        return self.kind != "none"

    @property
    def recomputes_matmuls(self) -> bool:
        """Whether some matmul of a layer runs again in the backward pass (all kinds that remat but ``dots``)."""
        return self.kind in ("full", "names", "offload")

    def recomputes(self, name: str | None) -> bool:
        """Whether a layer's activation tagged ``name`` (None: untagged) is recomputed in the backward pass.

        >>> Remat("names", ("mlp_hidden",)).recomputes("mlp_hidden"), Remat("full").recomputes("mlp_hidden")
        (False, True)
        """
        return self.kind == "full" or (self.kind in ("names", "offload") and name not in self.names)

    def merge(self, other: Remat) -> Remat:
        """The policy of two merged plans: the one that is set; two different ones are an error naming both.

        >>> Remat().merge(Remat("dots")).kind
        'dots'
        """
        if not self or self == other:
            return other
        if not other:
            return self
        raise PlanError(
            f"two remat policies in one plan: {self.describe()} and {other.describe()}; a plan applies one, keep one "
            f"(e.g. dataclasses.replace(plan, remat=...))"
        )

    def describe(self) -> str:
        """What the policy does to each layer, in words ('' for none).

        >>> Remat("dots").describe()
        'layers rematerialised (matmul outputs saved)'
        """
        what = {"full": "nothing saved", "dots": "matmul outputs saved"}.get(self.kind)
        if self.kind == "names":
            what = f"saved: {', '.join(self.names)}"
        elif self.kind == "offload":
            what = f"offloaded to host: {', '.join(self.names)}"
        return f"layers rematerialised ({what})" if self else ""

    def policy(self) -> Callable[..., Any] | None:
        """The ``jax.checkpoint`` policy (None for ``none``: no checkpoint at all).

        >>> Remat("full").policy() is jax.checkpoint_policies.nothing_saveable
        True
        """
        p = jax.checkpoint_policies
        if self.kind == "offload":
            return p.save_and_offload_only_these_names(
                names_which_can_be_saved=[],
                names_which_can_be_offloaded=list(self.names),
                offload_src="device",
                offload_dst="pinned_host",
            )
        return {
            "none": None,
            "full": p.nothing_saveable,
            "dots": p.checkpoint_dots,
            "names": p.save_only_these_names(*self.names) if self.kind == "names" else None,
        }[self.kind]

    def wrap(self, fn: Callable, *, prevent_cse: bool = True) -> Callable:
        """``fn`` under this policy (``jax.checkpoint``); ``fn`` itself for ``none``. Inside a scan's body pass
        ``prevent_cse=False``: the scan already keeps XLA from merging the recomputation away.

        >>> import jax.numpy as jnp
        >>> f = Remat("dots").wrap(lambda w, x: jnp.tanh(x @ w))
        >>> jax.grad(lambda w: f(w, jnp.ones((2, 3))).sum())(jnp.ones((3, 4))).shape
        (3, 4)
        """
        return jax.checkpoint(fn, policy=self.policy(), prevent_cse=prevent_cse) if self else fn

    def linen(self, module: type[nn.Module], *, prevent_cse: bool = True) -> type[nn.Module]:
        """A linen Module class under this policy (``nn.remat``); the class itself for ``none``.

        >>> Remat("full").linen(nn.Dense).__name__
        'CheckpointDense'
        """
        return nn.remat(module, policy=self.policy(), prevent_cse=prevent_cse) if self else module


def active_policy() -> Remat:
    """The active plan's policy (:func:`spmd.activate`, which spmd's training step does), else ``none``.

    >>> active_policy().kind
    'none'
    """
    current = active()
    return current[0].remat if current is not None else Remat()


def rematerialise(target: Any, *, prevent_cse: bool = True) -> Any:
    """``target`` (a function, or a linen Module class) rematerialised by the active plan's policy, read when it
    runs (when spmd's step traces the model), so one model definition follows whatever plan trains it. With no
    plan active, or a plan without a policy, it runs as it is.

    >>> import spmd, jax.numpy as jnp
    >>> layer = rematerialise(lambda w, x: jnp.tanh(x @ w))
    >>> plan = spmd.Plan(remat="dots")
    >>> with spmd.activate(plan, spmd.make_mesh({"data": -1})):
    ...     jaxpr = jax.make_jaxpr(jax.grad(lambda w: layer(w, jnp.ones((2, 3))).sum()))(jnp.ones((3, 4)))
    >>> "remat" in str(jaxpr) or "checkpoint" in str(jaxpr)
    True
    """
    if isinstance(target, type) and issubclass(target, nn.Module):
        return _linen_class(target, prevent_cse)
    if isinstance(target, type):  # an nnx Module class: wrapping its constructor would checkpoint its creation
        raise PlanError(
            f"spmd.rematerialise({target.__name__}): takes a function or a linen Module class; for an nnx module "
            f"wrap the function that calls it, e.g. rematerialise(lambda layer, x: layer(x))"
        )

    @functools.wraps(target)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        return active_policy().wrap(target, prevent_cse=prevent_cse)(*args, **kwargs)

    return wrapped


def _linen_class(cls: type[nn.Module], prevent_cse: bool) -> type[nn.Module]:
    # A subclass whose __call__ picks the policy when the module runs: the class itself cannot hold it, since
    # the plan is known only then.
    def __call__(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        policy = active_policy()
        if not policy:
            return cls.__call__(self, *args, **kwargs)
        return nn.remat(cls.__call__, policy=policy.policy(), prevent_cse=prevent_cse)(self, *args, **kwargs)

    doc = f"{cls.__name__} rematerialised by the active plan's remat policy (spmd.rematerialise)."
    return type(cls.__name__, (cls,), {"__call__": __call__, "__doc__": doc, "__module__": cls.__module__})
