"""Subnetwork data parallelism (SDP, Singh et al.): each data-parallel worker trains, and stores, only its
subnetwork.

The parameter groups are whole blocks (``granularity="block"``: the stacked layers) or, in every layer, MLP
hidden units, attention heads and convolution channels (``"neuron"``: the logical dimensions ``mlp``, ``heads``,
``channels``). With coverage ``C = 1/P`` the groups are cut into ``P`` equal
parts (a seeded permutation; per layer for neurons) and the workers into ``P`` equal owner groups (a seeded
permutation): every group has ``W/P`` owners, every worker holds the same share, and the ownership is a pure
function of the seed. Parameters outside any group (embeddings, norms, the head) are shared by all workers.

Each step a group's gradient is the mean of its owners' gradients, ``g_p = Σ_{i owns p} g_ip / |owners(p)|``,
and a shared parameter's the mean over all workers. The owners of a part are exactly one owner group, so that
mean is one ``psum`` over the group's devices (``axis_index_groups``): the reduction moves ``C`` of what data
parallelism moves. A loss that draws random numbers gets, on worker ``w``, the step's key folded with ``w``
(each worker's rows are its own part of the batch).

- ``masking="forward"``: each worker runs only its subnetwork (the model narrowed to its blocks, or to its units
  and heads), forward and backward. Owned arrays are stored ``[worker, ...]`` with the leading dimension split
  over the data axis: a device holds only its part, and its gradients and optimizer state.
- ``masking="backward"``: every worker runs the full model and keeps all parameters; only the owned gradients
  are reduced and applied, so gradients and optimizer state are stored per part, and the updated parts are
  gathered back into the full parameters.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from jax.sharding import Mesh, PartitionSpec

from spmd import axes as names
from spmd._executor import Executor, Summary, Task
from spmd._format import format_bytes
from spmd._keys import StepKey, call_loss, named
from spmd._rules import PlanError
from spmd._tree import is_box, key_name
from spmd.costmodel import Contribution, Workload, subnet_traffic

if TYPE_CHECKING:
    from spmd._specs import SubnetSpec

__all__ = ["Ownership", "Subnetworks", "ownership", "simulated_subnet_executor", "subnet_executor"]


@dataclasses.dataclass(frozen=True)
class Ownership:
    """Who owns what: ``part_of[w]`` is worker ``w``'s part; ``index[name][g]`` the groups part ``g`` owns along
    the logical dimension ``name`` (``[k]`` for blocks, ``[layers, k]`` for neurons), ascending.

    >>> import numpy as np
    >>> o = Ownership(workers=4, parts=2, part_of=(0, 1, 1, 0), index={"layers": np.array([[0, 2], [1, 3]])})
    >>> o.owner_groups, o.mask("layers").astype(int).tolist()  # part 0 (workers 0, 3) owns blocks 0 and 2
    ([[0, 3], [1, 2]], [[1, 0, 1, 0], [0, 1, 0, 1], [0, 1, 0, 1], [1, 0, 1, 0]])
    """

    workers: int
    parts: int
    part_of: tuple[int, ...]
    index: Mapping[str, np.ndarray]

    @property
    def owner_groups(self) -> list[list[int]]:
        """The workers of each part: the devices one gradient reduction spans."""
        return [[w for w in range(self.workers) if self.part_of[w] == g] for g in range(self.parts)]

    def mask(self, name: str, layer: int = 0) -> np.ndarray:
        """The worker × group ownership matrix M along ``name`` (in ``layer`` for neuron groups)."""
        index = self.index[name] if name == names.LAYERS else self.index[name][:, layer]
        m = np.zeros((self.workers, index.size), bool)
        for w in range(self.workers):
            m[w, index[self.part_of[w]]] = True
        return m


def ownership(spec: SubnetSpec, workers: int, sizes: Mapping[str, int], layers: int) -> Ownership:
    """The balanced ownership of groups of the given ``sizes`` (``{"layers": L}`` for blocks, ``{"mlp": U,
    "heads": H}`` for neurons, in each of ``layers``) among ``workers``: a pure function of ``spec.seed``.

    >>> from spmd.execution import SubnetSpec
    >>> o = ownership(SubnetSpec(coverage=0.5), 4, {"layers": 4}, 4)
    >>> o.owner_groups, o.mask("layers").sum(axis=0).tolist()  # every block owned by 2 workers
    ([[1, 2], [0, 3]], [2, 2, 2, 2])
    """
    parts = spec.parts
    if workers % parts:
        raise ValueError(
            f"sdp: coverage {spec.coverage:g} cuts the model into {parts} parts, which {workers} workers cannot share "
            f"equally; use a coverage 1/P with P dividing {workers}"
        )
    rng = np.random.default_rng(spec.seed)
    order = rng.permutation(workers)
    part_of = tuple(int(np.flatnonzero(order == w)[0]) % parts for w in range(workers))
    index = {}
    for name, size in sizes.items():
        if size % parts:
            raise ValueError(
                f"sdp: {size} {name} do not split into {parts} equal parts (coverage {spec.coverage:g}); use a "
                f"coverage 1/P with P dividing {size}"
            )
        k = size // parts

        def cut(perm: np.ndarray, k: int = k) -> np.ndarray:
            return np.stack([np.sort(perm[g * k : (g + 1) * k]) for g in range(parts)])

        if name == names.LAYERS:
            index[name] = cut(rng.permutation(size))  # [parts, k]
        else:
            index[name] = np.stack([cut(rng.permutation(size)) for _ in range(layers)], axis=1)  # [parts, layers, k]
    return Ownership(workers, parts, part_of, index)


class Subnetworks:
    """The engine of subnetwork data parallelism: lays parameters out per part, and computes SDP's gradients.

    ``loss_fn`` is the full model's loss; ``narrow(kept)`` gives the loss of the model narrowed to ``kept``
    groups per logical dimension (``{"layers": k}`` or ``{"mlp": k, "heads": k}``), for forward masking;
    ``params``: the model's abstract annotated parameters, whose names and group sizes fix the ownership.

    >>> import spmd, jax
    >>> from spmd import models
    >>> model = models.get("gpt-tiny", layers=4)
    >>> params = jax.eval_shape(model.init, jax.random.key(0))
    >>> engine = Subnetworks(spmd.execution.SubnetSpec(coverage=0.5), spmd.make_mesh({"data": -1}), None, None, params)
    >>> engine.sizes, engine.kept
    ({'layers': 4}, {'layers': 2})
    """

    def __init__(
        self,
        spec: SubnetSpec,
        mesh: Mesh,
        loss_fn: Callable[[Any, Any], jax.Array] | None,
        narrow: Callable[[Mapping[str, int]], Callable[[Any, Any], jax.Array]] | None,
        params: Any,
        layers_key: tuple[str, ...] = ("params", names.LAYERS),
        workers: int | None = None,
    ) -> None:
        if workers is None and spec.axis not in mesh.shape:
            raise ValueError(f"sdp: the mesh has no axis {spec.axis!r} ({dict(mesh.shape)}); add the data axis")
        self.spec, self.mesh, self.loss_fn, self.narrow, self.layers_key = spec, mesh, loss_fn, narrow, layers_key
        flat, _ = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_box)
        flat = [("/".join(key_name(k) for k in path), x) for path, x in flat]
        # Per path, the model's logical names.
        self.names = {path: tuple(x.names) if is_box(x) and hasattr(x, "names") else None for path, x in flat}
        self.sizes, layers = self._group_sizes(flat)
        self.owners = ownership(spec, workers or mesh.shape[spec.axis], self.sizes, layers)

    def _group_sizes(self, flat: list[tuple[str, Any]]) -> tuple[dict[str, int], int]:
        sizes: dict[str, int] = {}
        layers = 0
        for path, x in flat:
            dim = self._dim(path)
            if dim is None:
                continue
            shape = np.shape(x.value if is_box(x) else x)
            layers = shape[0]
            size = shape[0] if dim == names.LAYERS else shape[self.names[path].index(dim)]
            if sizes.setdefault(dim, size) != size:
                raise ValueError(f"sdp: {path} has {size} {dim} but another array has {sizes[dim]}")
        if not sizes:
            raise ValueError(
                f"sdp: no {self.spec.granularity} groups in the parameters (stacked layers at "
                f"{'/'.join(self.layers_key)}; neurons need logical names mlp/heads/channels)"
            )
        return sizes, layers

    # -- which arrays are grouped ----------------------------------------------------------------------------
    def _dim(self, path: str) -> str | None:
        """The logical dimension along which the array at ``path`` is cut into groups; None when shared."""
        if not path.startswith("/".join(self.layers_key) + "/"):
            return None
        if self.spec.granularity == "block":
            return names.LAYERS
        logical = self.names.get(path)
        return next((n for n in names.NEURONS if logical and n in logical), None)

    def _map(self, f: Callable[[str, Any], Any], tree: Any) -> Any:
        flat, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_box)
        return jax.tree_util.tree_unflatten(treedef, [f("/".join(key_name(k) for k in path), x) for path, x in flat])

    @property
    def kept(self) -> dict[str, int]:
        """Groups a worker keeps along each grouped dimension."""
        return {name: size // self.owners.parts for name, size in self.sizes.items()}

    # -- layouts ------------------------------------------------------------------------------------------
    def _take(self, path: str, x: jax.Array, parts: np.ndarray | jax.Array) -> jax.Array:
        """``[n, ...]``: for each of ``parts``, the groups it owns of the array ``x`` (full layout)."""
        dim = self._dim(path)
        index = jnp.asarray(self.owners.index[dim])[parts]  # [n, k] for blocks, [n, layers, k] for neurons
        if dim == names.LAYERS:
            return jnp.take(x, index, axis=0)
        axis = self.names[path].index(dim)  # >= 1: the leading dimension is the layer
        shape = [index.shape[0], index.shape[1]] + [1] * (x.ndim - 1)
        shape[1 + axis] = index.shape[2]
        return jnp.take_along_axis(x[None], index.reshape(shape), axis=1 + axis)

    def own(self, params: Any) -> Any:
        """Owned arrays laid out ``[worker, ...]`` (each worker's copy of its part); shared ones unchanged.
        Boxes (and abstract arrays, for planning) carry logical names with ``"worker"`` in front, which a plan
        maps to the data axis; plain arrays stay plain."""
        part_of = np.asarray(self.owners.part_of)

        def one(path: str, x: Any) -> Any:
            if self._dim(path) is None:
                return x
            value = x.value if is_box(x) else x
            stack = lambda v: self._take(path, v, part_of)  # noqa: E731
            abstract = isinstance(value, jax.ShapeDtypeStruct)
            value = jax.eval_shape(stack, value) if abstract else stack(value)
            logical = (names.WORKER,) + (self.names.get(path) or (None,) * (len(value.shape) - 1))
            if is_box(x):
                return x.replace(value=value, names=logical)
            return nn.LogicallyPartitioned(value, logical) if abstract else value

        return self._map(one, params)

    def full(self, owned: Any) -> Any:
        """The model's layout from the owned one: each group taken from its part's first owner."""
        first = [self.owners.part_of.index(g) for g in range(self.owners.parts)]
        return self._map(lambda path, x: self._joined(path, [x[w] for w in first]) if self._dim(path) else x, owned)

    def _joined(self, path: str, pieces: list[jax.Array]) -> jax.Array:
        """Each part's groups (``pieces[g]``: part ``g``'s) put together in the full layout."""
        dim = self._dim(path)
        index = self.owners.index[dim]  # [parts, k] or [parts, layers, k]
        if dim == names.LAYERS:
            return jnp.take(jnp.concatenate(pieces, axis=0), np.argsort(index.reshape(-1)), axis=0)
        axis = self.names[path].index(dim)
        order = np.argsort(np.concatenate(list(index), axis=-1), axis=-1)  # [layers, size]
        shape = [order.shape[0]] + [1] * (pieces[0].ndim - 1)
        shape[axis] = order.shape[1]
        return jnp.take_along_axis(jnp.concatenate(pieces, axis=axis), order.reshape(shape), axis=axis)

    def rebuild(self, owned: Any) -> Any:
        """The full parameters on every device from the owned layout, in one all-reduce: each part's first owner
        puts its part in place (zeros elsewhere, and everywhere on the other devices), and the sum is the whole,
        exactly."""
        axis, owners = self.spec.axis, self.owners
        part_of = jnp.asarray(owners.part_of)
        first = jnp.asarray([owners.part_of.index(owners.part_of[w]) == w for w in range(owners.workers)])

        def body(owned: Any) -> Any:
            worker = jax.lax.axis_index(axis)

            def one(path: str, x: jax.Array) -> jax.Array:
                if not self._dim(path):
                    return x
                zeros = jnp.zeros_like(x[0])
                placed = [
                    self._joined(path, [x[0] if g == h else zeros for h in range(owners.parts)])
                    for g in range(owners.parts)
                ]
                local = sum(jnp.where(part_of[worker] == g, p, 0) for g, p in enumerate(placed))
                return jax.lax.psum(jnp.where(first[worker], local, 0), axis)

            return self._map(one, owned)

        return jax.shard_map(
            body,
            mesh=self.mesh,
            in_specs=(self._specs(owned),),
            out_specs=jax.tree.map(lambda _: PartitionSpec(), owned),
            axis_names={axis},
            check_vma=False,
        )(owned)

    # -- gradients ----------------------------------------------------------------------------------------
    def _reduce(self, grads: Any) -> Any:
        """The SDP rule: owned groups average over their owners (one owner group's devices), shared parameters
        over all workers."""
        axis, owners = self.spec.axis, self.owners
        per_group = owners.workers // owners.parts

        def one(path: str, g: jax.Array) -> jax.Array:
            if self._dim(path):
                return jax.lax.psum(g, axis, axis_index_groups=owners.owner_groups) / per_group
            return jax.lax.psum(g, axis) / owners.workers

        return self._map(one, grads)

    def _specs(self, tree: Any) -> Any:
        """shard_map specs for the owned layout: owned arrays split over the axis, shared ones whole."""
        axis = self.spec.axis
        return self._map(lambda path, _: PartitionSpec(axis) if self._dim(path) else PartitionSpec(), tree)

    def value_and_grad(self, params: Any, batch: Any, draw: StepKey | None = None) -> tuple[jax.Array, Any]:
        """Forward masking: every worker's loss and gradients on its own subnetwork, reduced by the SDP rule.
        ``params`` and the gradients are in the owned layout; the loss is the workers' mean."""
        axis, sub_loss = self.spec.axis, self.narrow(self.kept)

        def body(params: Any, batch: Any, part: StepKey | None) -> tuple:
            local = self._map(lambda path, x: x[0] if self._dim(path) else x, params)
            loss, grads = jax.value_and_grad(lambda p: call_loss(sub_loss, p, batch, part))(local)
            grads = self._map(lambda path, g: g[None] if self._dim(path) else g, self._reduce(grads))
            return jax.lax.psum(loss, axis) / self.owners.workers, grads

        specs = self._specs(params)
        return _per_worker(body, self.mesh, axis, specs, specs)(params, batch, draw)

    def backward_value_and_grad(self, params: Any, batch: Any, draw: StepKey | None = None) -> tuple[jax.Array, Any]:
        """Backward masking: every worker's loss and gradients on the full model; of the owned groups only each
        worker's own part, reduced by the SDP rule, in the owned layout."""
        axis = self.spec.axis
        part_of = jnp.asarray(self.owners.part_of)

        def body(params: Any, batch: Any, draw: StepKey | None) -> tuple:
            loss, grads = jax.value_and_grad(lambda p: call_loss(self.loss_fn, p, batch, draw))(params)
            part = part_of[jax.lax.axis_index(axis)][None]
            own = self._map(lambda path, g: self._take(path, g, part)[0] if self._dim(path) else g, grads)
            grads = self._map(lambda path, g: g[None] if self._dim(path) else g, self._reduce(own))
            return jax.lax.psum(loss, axis) / self.owners.workers, grads

        replicated = jax.tree.map(lambda _: PartitionSpec(), params)
        return _per_worker(body, self.mesh, axis, replicated, self._specs(params))(params, batch, draw)

    # -- the report ---------------------------------------------------------------------------------------
    def figures(self, layout: Any) -> dict[str, Any]:
        """What each worker owns and what all share, per device, from a training-state layout."""
        owned = lambda rows: sum(r.bytes_per_device for r in rows if _owned(r))  # noqa: E731
        shared = lambda rows: sum(r.bytes_per_device for r in rows if not _owned(r))  # noqa: E731
        o = self.owners
        return {
            "coverage": self.spec.coverage,
            "granularity": self.spec.granularity,
            "masking": self.spec.masking,
            "parts": o.parts,
            "owners_per_group": o.workers // o.parts,
            "groups": dict(self.sizes),
            "owner_groups": o.owner_groups,
            "owned_param_bytes": owned(layout.params.leaves),
            "shared_param_bytes": shared(layout.params.leaves),
            "owned_grad_bytes": owned(layout.grads.leaves),
            "shared_grad_bytes": shared(layout.grads.leaves),
        }

    def summary(self, layout: Any, batch: Any) -> Summary:
        """Who owns what, for the report."""
        s = self.figures(layout)
        kept = (
            f"{format_bytes(s['owned_param_bytes'])} of owned parameters and "
            f"{format_bytes(s['shared_param_bytes'])} shared by all"
            if s["masking"] == "forward"
            else f"the full parameters, {format_bytes(s['owned_grad_bytes'])} of owned gradients"
        )
        text = (
            f"subnetworks: {s['parts']} parts ({s['granularity']}: {s['groups']}), each owned by "
            f"{s['owners_per_group']} workers {s['owner_groups']}; per device {kept}"
        )
        return Summary("subnet", s, text)

    def costs(self, layout: Any, batch: Any, workload: Workload) -> Contribution:
        """The reductions follow the ownership, not the layouts: the subnetworks' own traffic replaces data
        parallelism's."""
        return Contribution(tuple(subnet_traffic(self.figures(layout), self.spec.axis, masking=self.spec.masking)))


def _per_worker(body: Callable, mesh: Mesh, axis: str, param_specs: Any, grad_specs: Any) -> Callable:
    """``body(params, batch, draw)`` on each worker along ``axis``: its rows of the batch, the step's draw folded
    with its index."""

    def worker(params: Any, batch: Any, draw: StepKey | None) -> tuple:
        return body(params, batch, None if draw is None else draw.fold(jax.lax.axis_index(axis)))

    in_specs, out_specs = (param_specs, PartitionSpec(axis), PartitionSpec()), (PartitionSpec(), grad_specs)
    return jax.shard_map(worker, mesh=mesh, in_specs=in_specs, out_specs=out_specs, axis_names={axis}, check_vma=False)


def _owned(row: Any) -> bool:
    return bool(row.names) and row.names[0] == names.WORKER


def subnet_executor(spec: SubnetSpec, task: Task) -> Executor:
    """The executor of subnetwork data parallelism. Forward masking stores each worker's part (``[worker,
    ...]``) and runs the narrowed model; backward masking stores the full parameters, runs the full model, and
    the optimizer updates each worker's part (``trained``), put back into the full parameters after the update.

    >>> import spmd, strategies, jax
    >>> from spmd import models
    >>> model = models.get("gpt-tiny", layers=4)
    >>> plan = strategies.subnetwork_dp(masking="backward")
    >>> params = jax.eval_shape(model.init, jax.random.key(0))
    >>> task = spmd.execution.Task(models.loss_fn(model), plan, spmd.make_mesh({"data": -1}), params)
    >>> ex = subnet_executor(plan.execution, task)
    >>> ex.to_stored is spmd.execution.identity, ex.to_trained is spmd.execution.identity
    (True, False)
    """
    if spec.masking == "forward" and task.narrow is None:
        raise PlanError(
            "subnetwork data parallelism with forward masking runs each worker's narrowed model: pass "
            "narrow=lambda kept: loss of the model narrowed to kept (spmd.models.narrowed does it for the "
            "built-in GPTs), or use masking='backward'"
        )
    keyed = True
    if spec.masking == "forward":
        # Narrowed to nothing: the whole model; says first if the model cannot be narrowed at all. The workers run
        # the narrowed losses: they take the key only if those name it, else a drawing loss is refused.
        keyed = named(task.narrow({}))[0] >= named(task.loss)[0]
    engine = Subnetworks(spec, task.mesh, task.loss, task.narrow, task.params)
    shared = {"costs": engine.costs, "summary": engine.summary, "keyed": keyed, "engine": engine}
    if spec.masking == "forward":
        return Executor(engine.value_and_grad, to_stored=engine.own, to_model=engine.full, **shared)
    return Executor(engine.backward_value_and_grad, to_trained=engine.own, from_trained=engine.rebuild, **shared)


def _simulated_value_and_grad(
    engine: Subnetworks, params: Any, batch: Any, draw: StepKey | None = None
) -> tuple[jax.Array, Any]:
    """The same step on one device, in the model's layout (the ``--check`` reference): worker ``w`` of
    ``owners.workers`` takes its rows of the batch and ``draw.fold(w)``, runs its subnetwork (forward masking)
    or the full model keeping its own groups' gradients (backward), and the gradients are combined by the SDP
    rule. The owners of a part hold equal copies updated by equal gradients, so an elementwise optimizer on
    the full layout updates each part as every one of its owners does."""
    owners = engine.owners
    per_group = owners.workers // owners.parts
    forward = engine.spec.masking == "forward"
    loss_fn = engine.narrow(engine.kept) if forward else engine.loss_fn
    rows = jax.tree.leaves(batch)[0].shape[0] // owners.workers
    losses, grads = [], []
    for w in range(owners.workers):
        part = np.array([owners.part_of[w]])
        own = lambda path, x, part=part: engine._take(path, x, part)[0] if engine._dim(path) else x  # noqa: E731
        local = jax.tree.map(lambda x, w=w: x[w * rows : (w + 1) * rows], batch)
        key = None if draw is None else draw.fold(w)
        f = lambda p, local=local, key=key: call_loss(loss_fn, p, local, key)  # noqa: E731
        if forward:
            loss, g = jax.value_and_grad(f)(engine._map(own, params))
        else:
            loss, g = jax.value_and_grad(f)(params)
            g = engine._map(own, g)
        losses.append(loss)
        grads.append(g)

    def combine(path: str, *gs: jax.Array) -> jax.Array:
        if not engine._dim(path):
            return sum(gs) / owners.workers
        return engine._joined(path, [sum(gs[w] for w in group) / per_group for group in owners.owner_groups])

    flat = [jax.tree_util.tree_flatten_with_path(g, is_leaf=is_box)[0] for g in grads]
    paths = ["/".join(key_name(k) for k in path) for path, _ in flat[0]]
    combined = [combine(path, *(f[i][1] for f in flat)) for i, path in enumerate(paths)]
    return sum(losses) / owners.workers, jax.tree_util.tree_unflatten(jax.tree.structure(grads[0]), combined)


def simulated_subnet_executor(spec: SubnetSpec, workers: int, task: Task) -> Executor:
    """Subnetwork data parallelism over ``workers`` simulated on one device, in the model's layout: what
    ``--check`` compares an SDP run with (the reference of plain training would be another algorithm)."""
    if spec.masking == "forward" and task.narrow is None:
        raise PlanError("simulated subnetworks with forward masking need narrow= (see subnet_executor)")
    engine = Subnetworks(spec, task.mesh, task.loss, task.narrow, task.params, workers=workers)
    return Executor(functools.partial(_simulated_value_and_grad, engine), keyed=True, engine=engine)
