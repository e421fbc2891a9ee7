"""Suggest a plan: enumerate meshes and strategy compositions, rank them by the cost model, confirm by compiling.

Everything before confirmation is analytic (:func:`spmd.costmodel.estimate` on abstract parameters and mesh
sizes), so a laptop can plan for 64 devices; confirmation compiles the best few on the devices present (emulated
CPU devices will do) and reads their real memory and collectives.

>>> import jax, optax
>>> from spmd import costmodel
>>> from strategies import suggest
>>> params = {"w": jax.ShapeDtypeStruct((1024, 1024), "float32")}  # 4 MiB; with Adam's state 16 MiB
>>> ranked, _ = suggest.rank(params, costmodel.Workload(8, 16), costmodel.HARDWARE["h100"], devices=4,
...                          memory_per_device=8 << 20, optimizer=optax.adam(1e-3), max_tensor=1)
>>> suggest.pick(ranked, 8 << 20)[1]
'zero3 on data=4: the fastest modelled step ... plain data parallelism needs 20.25 MiB'
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from spmd import Plan, PlanError, Precision, Remat, costmodel, format_bytes, resolve_state
from spmd.devices import Profile
from spmd.execution import PipelineSpec, Shares, TensorShares, UnevenTensor
from strategies import Context, ContextOptions, PipelineOptions, from_names
from strategies.hetero import device_order, profiled_step_time, rank_speeds

# The data-parallel stages tried on a mesh whose data-parallel devices all sit on the data axis.
_DATA_STAGES = ("dp", "zero1", "zero2", "zero3", "osdp")


@dataclasses.dataclass(frozen=True)
class Suggestion:
    """One candidate: a mesh, a ``--strategy`` composition, what the cost model expects, and (once confirmed)
    what the compiler made of it.

    >>> import jax, optax
    >>> from spmd import costmodel
    >>> params = {"w": jax.ShapeDtypeStruct((1024, 1024), "float32")}  # 4 MiB; with Adam's state 16 MiB
    >>> ranked, skipped = rank(params, costmodel.Workload(8, 16), costmodel.HARDWARE["h100"], devices=4,
    ...                        memory_per_device=8 << 20, optimizer=optax.adam(1e-3), max_tensor=1)
    >>> best = ranked[0]
    >>> best.strategy, best.mesh, best.fits, best.confirmed  # modelled to fit; not compiled yet
    ('zero3', {'data': 4}, True, None)
    """

    mesh: dict[str, int]
    strategy: str
    plan: Plan
    estimate: costmodel.Estimate
    fits: bool  # modelled memory within the budget
    compiled_memory: dict[str, int] | None = None
    compiled_comm_bytes: int | None = None
    confirmed: bool | None = None  # whether the compiled program's peak fits the budget (None: not compiled)
    flags: tuple[str, ...] = ()  # the training policies chosen beyond the strategy's own, as spmd run flags
    profiled_s: float | None = None  # the modelled step on a device profile's devices (None: no profile)

    @property
    def step_s(self) -> float:
        """The modelled step time it is ranked by: on the profile's devices where one is given."""
        return self.estimate.time.total_s if self.profiled_s is None else self.profiled_s

    def to_dict(self) -> dict[str, Any]:
        return {
            "mesh": self.mesh,
            "strategy": self.strategy,
            "plan": self.plan.describe(),
            "notes": list(self.plan.notes),
            "policies": " ".join(self.flags),
            "fits": self.fits,
            "modelled": self.estimate.to_dict(),
            "modelled_step_on_profile_s": self.profiled_s,
            "batch_shares": list(self.plan.execution.shares) if isinstance(self.plan.execution, Shares) else None,
            "tensor_units": dict(self.plan.execution.units) if isinstance(self.plan.execution, TensorShares) else None,
            **_pipeline_split(self.plan.execution),
            "compiled_memory": self.compiled_memory,
            "compiled_comm_bytes": self.compiled_comm_bytes,
            "confirmed": self.confirmed,
        }


def _pipeline_split(spec: Any) -> dict[str, Any]:
    """A pipeline's schedule, microbatches, layers per global stage and its data positions' microbatches (None
    for a plan without a pipeline)."""
    if not isinstance(spec, PipelineSpec):
        return dict.fromkeys(("schedule", "microbatches", "layers_per_stage", "rank_microbatches"))
    return {
        "schedule": spec.schedule.name,
        "microbatches": spec.schedule.microbatches,
        "layers_per_stage": list(spec.layers_per_stage) if spec.layers_per_stage else None,
        "rank_microbatches": list(spec.rank_microbatches) if spec.data_schedules else None,
    }


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def compositions(
    devices: int, *, max_tensor: int = 8, contexts: Sequence[int] = (1,), stages: Sequence[int] = (1,)
) -> Iterator[tuple[dict[str, int], str]]:
    """Every (mesh, strategy) tried for ``devices``: the data-parallel devices as one ``data`` axis (DP, ZeRO-1/2/3,
    OSDP) or as ``data`` × ``fsdp`` (HSDP), times a ``context`` axis of each size in ``contexts`` (the sequence
    split over it, cp), times a ``tensor`` axis of up to ``max_tensor`` devices (tensor or sequence parallel)
    placed innermost, on the fastest links, with the context axis next to it (its exchanges run every layer).
    Each size in ``stages`` above 1 adds pipelines over a ``stage`` axis (pp), outermost or inside the ``data``
    axis (a data position's stages on neighbouring devices: on a device profile, a position of one kind can
    take microbatches by its speed), each stage's devices data-parallel (dp, or dp+fsdp) and tensor-parallel as
    above, without a context axis.

    >>> [s for m, s in compositions(4, max_tensor=2) if m.get("tensor", 1) == 2]
    ['dp+tp', 'dp+sp', 'zero1+tp', 'zero1+sp', 'zero2+tp', 'zero2+sp', 'zero3+tp', 'zero3+sp', 'osdp+tp', 'osdp+sp']
    >>> [(m, s) for m, s in compositions(4, max_tensor=1, contexts=(2, 4)) if s in ("dp+cp", "cp")]
    [({'data': 2, 'context': 2}, 'dp+cp'), ({'context': 4}, 'cp')]
    >>> [(m, s) for m, s in compositions(4, max_tensor=2, stages=(2,)) if s == "pp+dp" or "tensor" in m][:3]
    [({'stage': 2, 'data': 2}, 'pp+dp'), ({'data': 2, 'stage': 2}, 'pp+dp'), ({'stage': 2, 'tensor': 2}, 'pp+tp')]
    """
    for stage in stages:
        if devices % stage:
            continue
        for context in contexts if stage == 1 else (1,):
            within = devices // stage
            for tensor in _divisors(within // context if within % context == 0 else 0):
                if tensor > max_tensor:
                    break
                for mesh, strategy in _compositions(within // (context * tensor), context, tensor, stage > 1):
                    if stage == 1:
                        yield mesh, strategy
                        continue
                    strategy = "+".join(filter(None, ("pp", strategy)))
                    yield {"stage": stage} | mesh, strategy
                    if "data" in mesh:  # each data position's stages on neighbouring devices
                        yield {"data": mesh["data"], "stage": stage} | mesh, strategy


def _compositions(
    rest: int, context: int, tensor: int, pipelined: bool = False
) -> Iterator[tuple[dict[str, int], str]]:
    """The compositions with ``rest`` data-parallel devices outside a ``context`` and a ``tensor`` axis (inside a
    pipeline's stage: data parallelism, with FSDP over an axis of its own or not)."""
    # sp splits the sequence over the tensor axis, which cp already splits over its own: only tp joins cp.
    tails = [("tensor", tensor, t) for t in ("tp", "sp") if t == "tp" or context == 1] if tensor > 1 else []
    tails = tails or [(None, 1, None)]
    inner = {"context": context} if context > 1 else {}
    cp = "cp" if context > 1 else None
    shapes: list[tuple[dict[str, int], list[str]]] = []
    if rest > 1:
        shapes.append(({"data": rest}, ["dp"] if pipelined else list(_DATA_STAGES)))
        for fsdp in _divisors(rest)[1:-1]:
            shapes.append(({"data": rest // fsdp, "fsdp": fsdp}, ["dp+fsdp"]))
    elif tensor > 1 or context > 1 or pipelined:
        shapes.append(({}, [""]))
    for axes, stages in shapes:
        for stage in stages:
            for axis, size, tail in tails:
                mesh = dict(axes) | inner | ({axis: size} if axis else {})
                yield mesh, "+".join(p for p in (stage, cp, tail) if p)


def rank(
    params: Any,
    workload: costmodel.Workload,
    hardware: costmodel.Hardware,
    *,
    devices: int,
    memory_per_device: int,
    optimizer: Any,
    max_tensor: int = 8,
    remat: Remat | None = None,
    remats: Sequence[Remat | str] = (),
    accumulations: Sequence[int] = (1,),
    precisions: Sequence[Precision | None] = (None,),
    contexts: Sequence[int] = (1,),
    context_options: ContextOptions | None = None,
    profile: Profile | None = None,
    microbatch: int = 1,
    stages: Sequence[int] = (1,),
    schedules: Sequence[str] = ("1f1b",),
    microbatches_per_stage: Sequence[int] = (2,),
    price: Callable[[Mapping[str, int], Plan], tuple[Any, costmodel.Contribution]] | None = None,
) -> tuple[list[Suggestion], list[str]]:
    """All compositions the model allows, fitting ones first, each group fastest first by modelled step time;
    and one line per composition that could not be planned (a dimension no axis divides, a batch too small).
    ``remat``, if given, replaces every plan's remat policy.

    The training policies are searched with the strategies: each composition under its own remat policy and
    each of ``remats``, each of ``accumulations`` (microbatches per step) the batch divides into, and each of
    ``precisions``; among equally fast plans, fewer microbatches and less recompute first. Each layout is
    resolved once: a policy changes what a device keeps, moves and computes, not where arrays live. Each size
    in ``contexts`` above 1 adds the compositions that split the sequence over a ``context`` axis (cp, with
    head-tail load balancing: the sequence must split into two half-chunks per device), by ``context_options``,
    each with the parameters replicated over that axis and split over it (flag ``--cp-shard-params``). Each size
    in ``stages`` above 1 adds pipelines (pp) over a ``stage`` axis, each under every one of ``schedules`` with
    each of ``microbatches_per_stage`` times the stages' microbatches, under the plan's own remat policy (a
    pipeline keeps what its slots hold). A pipeline's layout (its stacked stages) and what its schedule costs
    (the bubble, the sends between stages, the slots) come from its executor: ``price(mesh, plan)`` returns the
    ``(layout, contribution)`` of a :class:`spmd.TrainStep` built for it (``step.layout`` and
    ``step.executor.costs``), which a model without stacked layers refuses (the composition is skipped). On a
    ``profile``, each mesh takes the devices in the order ``spmd run`` lays them out in
    (:func:`strategies.hetero.device_order`): a suggestion's plan runs on a mesh built in that order.

    >>> import jax, optax
    >>> from spmd import costmodel
    >>> params = {"w": jax.ShapeDtypeStruct((1024, 1024), "float32")}  # 4 MiB; with Adam's state 16 MiB
    >>> ranked, skipped = rank(params, costmodel.Workload(8, 16), costmodel.HARDWARE["h100"], devices=4,
    ...                        memory_per_device=8 << 20, optimizer=optax.adam(1e-3), max_tensor=1)
    >>> [(s.strategy, s.fits) for s in ranked], skipped
    ([('zero3', True), ('osdp', True), ('dp', False), ('zero2', False), ('zero1', False), ('dp+fsdp', False)], [])
    """
    if any(n > 1 for n in stages) and price is None:
        raise ValueError("suggest.rank prices pipelines by their executor: pass price=(mesh, plan) -> (layout, costs)")
    search = _Search(
        plain=Context(params, workload, hardware, optimizer, memory_per_device), profile=profile,
        microbatch=microbatch, remat=remat, remats=remats, accumulations=accumulations, precisions=precisions,
        context_options=context_options, price=price,
    )  # fmt: skip
    out: list[Suggestion] = []
    skipped: list[str] = []
    tried = compositions(devices, max_tensor=max_tensor, contexts=contexts, stages=stages)
    for (mesh, strategy), pipe in _with_pipelines(tried, schedules, microbatches_per_stage):
        search.add(mesh, strategy, pipe, out, skipped)
    out.sort(key=lambda s: (not s.fits, s.step_s, s.plan.accumulate, s.estimate.flops))
    return out, list(dict.fromkeys(skipped))


@dataclasses.dataclass(frozen=True)
class _Search:
    """What :func:`rank` tries every composition under: the plain context (the model, workload, hardware,
    optimizer and budget), the device profile and its microbatch, the remat policy that replaces every plan's
    (or None), the policies searched, the cp options, and the pricing of an executed plan."""

    plain: Context
    profile: Profile | None
    microbatch: int
    remat: Remat | None
    remats: Sequence[Remat | str]
    accumulations: Sequence[int]
    precisions: Sequence[Precision | None]
    context_options: ContextOptions | None
    price: Callable[[Mapping[str, int], Plan], tuple[Any, costmodel.Contribution]] | None

    def add(
        self,
        mesh: dict[str, int],
        strategy: str,
        pipe: tuple[PipelineOptions | None, tuple[str, ...]],
        out: list[Suggestion],
        skipped: list[str],
    ) -> None:
        """Appends to ``out`` each plan of ``strategy`` on ``mesh`` (under each of the options tried) with its
        estimate, and to ``skipped`` why one could not be planned."""
        (options, pipe_flags), ctx = pipe, self.plain
        workload = ctx.workload
        shown = ",".join(f"{k}={v}" for k, v in mesh.items())
        ways = mesh.get("data", 1) * mesh.get("fsdp", 1)
        if workload.batch % (ways * (options.microbatches if options is not None else 1)):
            what = f"{ways} ways" if options is None else f"{ways} ways into {options.microbatches} microbatches each"
            skipped.append(f"{strategy} on {shown}: batch {workload.batch} does not split {what}")
            return
        usable = [k for k in self.accumulations if workload.batch % (k * ways) == 0] if options is None else [1]
        # The devices fill the mesh in the order spmd run lays them out in.
        profile = self.profile
        if profile is not None:
            profile = profile.reordered(device_order(profile, mesh, pipelined="stage" in mesh))
        # A profile gives the data-parallel ranks uneven shares, a pipeline's stages uneven layers, and a tensor
        # axis whose positions differ in speed uneven heads and units; a plan with none of them stays even.
        varied = mesh.get("data", 1) > 1 or "stage" in mesh or _tensor_differs(profile, mesh)
        if profile is not None and varied:
            ctx = dataclasses.replace(ctx, profile=profile, microbatch=self.microbatch)
        for context, cp, split_flags in _tried(strategy, self.context_options, ctx, workload.batch, ways, profile):
            try:
                plan = from_names(strategy, mesh, context=context, context_options=cp, pipeline_options=options)
                plan = plan if self.remat is None else dataclasses.replace(plan, remat=self.remat)
                plan.check_mesh(mesh)
                if plan.context is not None:  # the sequence must split over the context axis
                    plan.context.check_length(workload.seq_len, mesh[plan.context.axis], "a sequence")
                # The mesh's axis order too: it places the devices (a dict's equality would not see it).
                key = (tuple(mesh.items()), plan.parts, plan.remat, plan.execution)
                if any((tuple(s.mesh.items()), s.plan.parts, s.plan.remat, s.plan.execution) == key for s in out):
                    continue  # osdp that shards nothing is the data-parallel plan again
                looped = usable if not isinstance(plan.execution, Shares) else [1]  # shares loop over microbatches
                priced = list(self._priced(plan, mesh, looped))
            except (PlanError, ValueError) as e:
                skipped.append(f"{strategy} on {shown}: {' '.join(str(e).split())}")
                continue
            for variant, flags, layout, contribution in priced:
                est = costmodel.estimate_layout(layout, variant, mesh, workload, ctx.hardware, contribution)
                on = None
                if profile is not None:
                    on = profiled_step_time(
                        variant, mesh, profile, workload.batch, est, params=ctx.params, workload=workload,
                        compute_factor=contribution.compute_factor,
                    )  # fmt: skip
                fits = est.memory_bytes <= ctx.memory_per_device
                out.append(
                    Suggestion(
                        mesh, strategy, variant, est, fits, flags=pipe_flags + split_flags + flags, profiled_s=on
                    )
                )

    def _priced(
        self, plan: Plan, mesh: Mapping[str, int], accumulations: Sequence[int]
    ) -> Iterator[tuple[Plan, tuple[str, ...], Any, costmodel.Contribution]]:
        """Each policy variant of ``plan`` with its flags, its state's layout and what its execution
        contributes: SPMD plans share one layout (a policy changes what a device keeps, moves and computes, not
        where arrays live); a pipeline's come from its executor (``price``), under the plan's own remat
        policy."""
        if isinstance(plan.execution, PipelineSpec):
            for variant, flags in _variants(plan, (), accumulations, self.precisions):
                yield variant, flags, *self.price(mesh, variant)
            return
        layout = resolve_state(plan, _stored(plan, self.plain.params), self.plain.optimizer, mesh)
        for variant, flags in _variants(plan, self.remats, accumulations, self.precisions):
            yield variant, flags, layout, costmodel.Contribution()


def _with_pipelines(
    tried: Iterator[tuple[dict[str, int], str]], schedules: Sequence[str], per_stage: Sequence[int]
) -> Iterator[tuple[tuple[dict[str, int], str], tuple[PipelineOptions | None, tuple[str, ...]]]]:
    """Each composition with the pipeline options it is tried under (None for one without a pipeline) and the
    ``spmd run`` flags that ask for them (none for run's defaults: 1f1b, twice the stages' microbatches)."""
    for mesh, strategy in tried:
        if "stage" not in mesh:
            yield (mesh, strategy), (None, ())
            continue
        for schedule, k in itertools.product(schedules, per_stage):
            microbatches = k * mesh["stage"]
            flags = ("--schedule", schedule) if schedule != "1f1b" else ()
            flags += ("--microbatches", str(microbatches)) if k != 2 else ()
            yield (mesh, strategy), (PipelineOptions(schedule, microbatches), flags)


def _stored(plan: Plan, params: Any) -> Any:
    """The parameters as ``plan`` stores them: uneven tensor shares pad their units (the state is that size)."""
    return (
        UnevenTensor(plan.execution, params).to_stored(params) if isinstance(plan.execution, TensorShares) else params
    )


def _tensor_differs(profile: Profile | None, mesh: Mapping[str, int]) -> bool:
    """Whether the positions of ``mesh``'s tensor axis differ in speed on the devices of ``profile``."""
    return profile is not None and mesh.get("tensor", 1) > 1 and len(set(rank_speeds(profile, mesh, "tensor"))) > 1


def _tried(
    strategy: str, options: ContextOptions | None, ctx: Context, batch: int, ways: int, profile: Profile | None
) -> Iterator[tuple[Context, ContextOptions | None, tuple[str, ...]]]:
    """The (context, cp options, run flags) a composition is tried with: the cp options of
    :func:`_context_splits`; under a profile, each microbatch size the uneven shares can loop over (doubling
    while the batch holds one per data-parallel device: fewer, larger microbatches gather FSDP's parameters less
    often, smaller ones follow the speeds closer), and the even split (``--even``), which a plan without a data
    axis keeps."""
    contexts = [(ctx, ())] if profile is None else [(dataclasses.replace(ctx, profile=None), ("--even",))]
    if ctx.profile is not None:
        sizes = [ctx.microbatch]
        while batch % (2 * sizes[-1] * ways) == 0:
            sizes.append(2 * sizes[-1])
        chosen = lambda size: ("--microbatch", str(size)) if size != ctx.microbatch else ()  # noqa: E731
        contexts += [(dataclasses.replace(ctx, microbatch=size), chosen(size)) for size in sizes]
    for cp, flags in _context_splits(strategy, options):
        for context, extra in contexts:
            yield context, cp, flags + extra


def _context_splits(
    strategy: str, options: ContextOptions | None
) -> list[tuple[ContextOptions | None, tuple[str, ...]]]:
    """The context options a composition is tried with: as given, and for cp with the parameters split over
    the context axis too (FSDP over it: the state split that many ways more, for its gathers)."""
    if "cp" not in strategy.split("+") or (options is not None and options.shard_params):
        return [(options, ())]
    split = dataclasses.replace(options or ContextOptions(), shard_params=True)
    return [(options, ()), (split, ("--cp-shard-params",))]


def _variants(
    plan: Plan, remats: Sequence[Remat | str], accumulations: Sequence[int], precisions: Sequence[Precision | None]
) -> Iterator[tuple[Plan, tuple[str, ...]]]:
    """``plan`` under each combination of the policies, with the ``spmd run`` flags that ask for it."""
    policies = [(plan.remat, ())]
    for r in map(Remat.of, remats):
        if all(r != seen for seen, _ in policies):
            policies.append((r, ("--remat", r.form)))
    for (policy, remat_flags), k, precision in itertools.product(policies, accumulations, precisions):
        flags = remat_flags + (("--accumulate", str(k)) if k > 1 else ())
        flags += ("--precision", "bf16") if precision is not None else ()
        yield dataclasses.replace(plan, remat=policy, accumulate=k, precision=precision), flags


def confirm(
    ranked: list[Suggestion],
    compile_report: Callable[[Mapping[str, int], Plan], Any],
    *,
    memory_per_device: int,
    top: int = 3,
    max_compiles: int | None = None,
) -> list[Suggestion]:
    """Compiles fitting suggestions in rank order (``compile_report(mesh, plan)`` returns a
    :class:`spmd.Report`) until ``top`` of them are confirmed to fit by their compiled peak memory, or
    ``max_compiles`` (default ``3 * top``) have been compiled; records the compiled memory and traffic.

    >>> import jax, optax
    >>> from spmd import costmodel
    >>> params = {"w": jax.ShapeDtypeStruct((1024, 1024), "float32")}  # 4 MiB; with Adam's state 16 MiB
    >>> ranked, skipped = rank(params, costmodel.Workload(8, 16), costmodel.HARDWARE["h100"], devices=4,
    ...                        memory_per_device=8 << 20, optimizer=optax.adam(1e-3), max_tensor=1)
    >>> import types  # a stand-in for compiling: spmd.report of a TrainStep on that mesh and plan
    >>> compiled = lambda mesh, plan: types.SimpleNamespace(compiled_memory={"peak_bytes": 1 << 20},
    ...                                                     comm_bytes_per_step={"compiled": 0})
    >>> [(s.strategy, s.confirmed) for s in confirm(ranked, compiled, memory_per_device=8 << 20, top=1)][:3]
    [('zero3', True), ('osdp', None), ('dp', None)]
    """
    budget = 3 * top if max_compiles is None else max_compiles
    fitted = compiled = 0
    out = []
    for s in ranked:
        if s.fits and fitted < top and compiled < budget:
            report = compile_report(s.mesh, s.plan)
            memory = dict(report.compiled_memory)
            fits = memory.get("peak_bytes", 0) <= memory_per_device
            s = dataclasses.replace(
                s, compiled_memory=memory, compiled_comm_bytes=report.comm_bytes_per_step["compiled"], confirmed=fits
            )
            compiled += 1
            fitted += fits
        out.append(s)
    return out


def pick(suggestions: list[Suggestion], memory_per_device: int) -> tuple[Suggestion | None, str]:
    """The fastest suggestion whose compiled program fits (else the fastest modelled to fit and not refuted by
    its compile), and why.

    >>> import jax, optax
    >>> from spmd import costmodel
    >>> params = {"w": jax.ShapeDtypeStruct((1024, 1024), "float32")}  # 4 MiB; with Adam's state 16 MiB
    >>> ranked, skipped = rank(params, costmodel.Workload(8, 16), costmodel.HARDWARE["h100"], devices=4,
    ...                        memory_per_device=8 << 20, optimizer=optax.adam(1e-3), max_tensor=1)
    >>> best, why = pick(ranked, 8 << 20)
    >>> best.strategy, why
    ('zero3', 'zero3 on data=4: the fastest modelled step ... of the plans modelled to fit 8.00 MiB; not confirmed ...')
    """
    budget = format_bytes(memory_per_device)
    confirmed = [s for s in suggestions if s.confirmed]
    unrefuted = [s for s in suggestions if s.fits and s.confirmed is not False]
    best = confirmed[0] if confirmed else unrefuted[0] if unrefuted else None
    if best is None:
        least = min(suggestions, key=lambda s: s.estimate.memory_bytes, default=None)
        need = (
            ""
            if least is None
            else f"; the smallest ({least.strategy}) needs {format_bytes(least.estimate.memory_bytes)}"
        )
        return None, f"no plan fits {budget} per device{need}"
    mesh = ",".join(f"{k}={v}" for k, v in best.mesh.items())
    t = best.estimate.time
    devices = t.hardware if best.profiled_s is None else f"the profile's devices, at {t.hardware} speed for the fastest"
    why = f"{best.strategy} on {mesh}: the fastest modelled step ({best.step_s * 1e3:.3g} ms on {devices})"
    refuted = [s for s in suggestions if s.confirmed is False]
    if best.confirmed:
        why += f" whose compiled peak ({format_bytes(best.compiled_memory['peak_bytes'])}) fits {budget}"
    else:
        why += f" of the plans modelled to fit {budget}; not confirmed by compiling"
    if refuted:
        faster = [s.strategy + " on " + ",".join(f"{k}={v}" for k, v in s.mesh.items()) for s in refuted]
        why += f"; modelled to fit but compiled too large: {', '.join(faster)}"
    dp = next((s for s in suggestions if s.strategy == "dp" and set(s.mesh) == {"data"}), None)
    if dp is not None and not (dp.fits and dp.confirmed is not False):
        peak = dp.compiled_memory["peak_bytes"] if dp.compiled_memory else dp.estimate.memory_bytes
        why += f"; plain data parallelism needs {format_bytes(peak)}"
    return best, why


__all__ = ["Suggestion", "compositions", "confirm", "pick", "rank"]
