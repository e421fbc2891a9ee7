"""What every command works with, built once from the command line: the mesh, the model, the plan, the
optimizer, the cost model's hardware and the devices' profile (:class:`Setup`)."""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from typing import Any

import jax
import jax.numpy as jnp
import optax

import spmd
import strategies
from spmd import costmodel, data, models
from spmd._context import initialising
from spmd._mesh import auto_twin
from spmd._remat import MATMUL_OUTPUTS
from spmd.cli.parser import UsageError
from spmd.devices import Profile, parse_bytes
from spmd.execution import PipelineSpec, Shares
from spmd.pipeline import Schedule

__all__ = [
    "Setup",
    "context_options",
    "hardware_of",
    "optimizer_of",
    "profile_of",
    "schedule_arg",
    "setup",
    "size_overrides",
]


@dataclasses.dataclass(frozen=True)
class Setup:
    """A command's model (and its abstract annotated parameters), mesh, plan, optimizer, hardware and device
    profile (None: homogeneous devices), with the batch size and seed of its data, and what a step does with a
    non-finite loss (``on_nan``: ``stop`` applies the update and the run stops; ``skip`` keeps the state)."""

    model: models.Model
    params: Any
    mesh: jax.sharding.Mesh
    plan: spmd.Plan
    optimizer: optax.GradientTransformation
    hardware: costmodel.Hardware
    profile: Profile | None
    batch_size: int
    seed: int
    on_nan: str = "stop"

    def step(self, *, plan: spmd.Plan | None = None) -> spmd.TrainStep:
        """The training step of this setup (or of another plan, for the same model and mesh)."""
        model = self.model
        return spmd.TrainStep(
            models.loss_fn(model),
            self.optimizer,
            plan or self.plan,
            self.mesh,
            params=self.params,
            staged=model.staged,
            narrow=lambda kept: models.loss_fn(models.narrowed(model, kept)),
            skip_nonfinite=self.on_nan == "skip",
        )

    def batch(self, step: int) -> dict[str, Any]:
        """The data of training step ``step``."""
        c = self.model.config
        return data.batch(self.seed, step, self.batch_size, c.seq_len, c.vocab)

    def abstract_batch(self) -> dict[str, Any]:
        return {"tokens": jax.ShapeDtypeStruct((self.batch_size, self.model.config.seq_len), jnp.int32)}


def setup(
    args: argparse.Namespace,
    *,
    model_name: str | None = None,
    mesh_text: str | None = None,
    strategy: str | None = None,
) -> Setup:
    """The setup the command line asks for (``model_name``, ``mesh_text``, ``strategy``: instead of the flags').
    Strategies the cost model chooses get their context here, and a device profile makes the plan uneven."""
    explicit = getattr(args, "axis_types", "explicit") == "explicit"  # the demo has no flag: the default
    mesh = _mesh(spmd.parse_mesh(mesh_text or args.mesh), _dcn(args), explicit)
    profile = profile_of(args, mesh.size)
    pipelined = "pp" in (strategy or args.strategy).split("+")
    order = None if profile is None else strategies.hetero.device_order(profile, dict(mesh.shape), pipelined=pipelined)
    if order is not None and order != tuple(range(mesh.size)):
        mesh = spmd.make_mesh(dict(mesh.shape), devices=[mesh.devices.flat[i] for i in order], explicit=explicit)
        profile = profile.reordered(order)
    name = model_name or args.model
    model, params = _load(name, args, mesh)
    hardware, optimizer = hardware_of(args, profile, mesh.axis_names), optimizer_of(args)
    plan = _plan(args, strategy or args.strategy, model, params, mesh, hardware, optimizer, profile)
    accumulate = getattr(args, "accumulate", 1)
    if accumulate > 1:
        plan = plan.with_accumulation(accumulate)
        # Uneven shares, and a pipeline's data positions with their own schedules, take the whole accumulated
        # microbatch and split it by their own counts (checked there); other modes split it over the batch axes.
        uneven = isinstance(plan.execution, Shares) or (
            isinstance(plan.execution, PipelineSpec) and plan.execution.data_schedules is not None
        )
        split = {} if uneven else {a: mesh.shape[a] for a in plan.batch_axes}
        spmd.execution.check_batch(args.batch_size, accumulate, split)
    if isinstance(plan.execution, PipelineSpec) and model.staged is None:
        raise UsageError(
            f"model {model.name!r} cannot be pipelined: pp needs the model cut into stages (models.Model.staged; "
            f"the built-in GPTs gpt-tiny, gpt-small and their -nnx twins have one)"
        )
    if getattr(args, "remat", None) is not None:  # --remat overrides the strategy's policy
        plan = dataclasses.replace(plan, remat=args.remat)
    if "activations" in (getattr(args, "offload", None) or ()):
        plan = dataclasses.replace(plan, remat=_offloaded_activations(getattr(args, "remat", None)))
    if plan.remat and name in models.BUILTIN:  # user factories need not know the option
        model = models.rematerialised(model, plan.remat)
    on_nan = getattr(args, "on_nan", "stop")
    return Setup(model, params, mesh, plan, optimizer, hardware, profile, args.batch_size, args.seed, on_nan)


def _offloaded_activations(remat: spmd.Remat | None) -> spmd.Remat:
    """``--offload activations``: the layers keep their matmul outputs for the backward pass in host memory (the
    remat policy ``offload:`` of the built-in models' :data:`spmd._remat.MATMUL_OUTPUTS`), unless ``--remat`` names
    an offload policy of its own; any other ``--remat`` asks for something else, and is refused."""
    if remat is None:
        return spmd.Remat("offload", MATMUL_OUTPUTS)
    if remat.kind != "offload":
        raise UsageError(
            f"--offload activations keeps the layers' matmul outputs in host memory (--remat offload:"
            f"{','.join(MATMUL_OUTPUTS)}), and --remat {remat.kind} asks for another policy: drop one of the two"
        )
    return remat


def size_overrides(name: str, args: argparse.Namespace) -> dict[str, int]:
    """The model sizes the command line overrides: ``--layers`` for any model, ``--seq-len`` for the built-in ones
    (a user model's factory sets its own sequence length)."""
    overrides = {"layers": args.layers} if getattr(args, "layers", None) else {}
    if getattr(args, "seq_len", None):
        if name not in models.BUILTIN:
            raise UsageError(f"--seq-len applies to the built-in models; {name} sets its own sequence length")
        overrides["seq_len"] = args.seq_len
    return overrides


def _load(name: str, args: argparse.Namespace, mesh: jax.sharding.Mesh) -> tuple[models.Model, Any]:
    """The model, and its parameters' shapes (planned once, for every use). A model that constrains a layout by a
    bare PartitionSpec needs a context mesh to be traced: it is loaded again under this run's (over Auto axes)."""

    overrides = size_overrides(name, args)
    if getattr(args, "precision", "fp32") == "bf16" and name in models.BUILTIN:
        # The built-in models cast their kernels to their own dtype: under a float32 config flax would widen
        # the bf16 parameters again, undoing the saving. A user model keeps the dtype its factory gives it.
        overrides["dtype"] = jnp.bfloat16

    def load() -> tuple[models.Model, Any]:
        model = models.get(name, **overrides)
        return model, jax.eval_shape(model.init, jax.random.key(args.seed))

    try:
        return load()
    except models.NeedsMesh:
        with initialising(spmd.Plan(), auto_twin(mesh)):
            return load()


def _plan(
    args: argparse.Namespace,
    strategy: str,
    model: models.Model,
    params: Any,
    mesh: jax.sharding.Mesh,
    hardware: costmodel.Hardware,
    optimizer: optax.GradientTransformation,
    profile: Profile | None,
) -> spmd.Plan:
    uneven = profile if profile is not None and not getattr(args, "even", False) else None
    context = None
    if set(strategy.split("+")) & set(strategies.CHOSEN) or uneven is not None:
        context = strategies.Context(
            params,
            # What one step runs at once: one accumulated microbatch (uneven shares are planned for it).
            costmodel.Workload(batch=args.batch_size // getattr(args, "accumulate", 1), seq_len=model.config.seq_len),
            hardware,
            optimizer,
            getattr(args, "memory_per_device", None),
            profile=uneven,
            microbatch=getattr(args, "microbatch", 1),
        )
    options = None
    if hasattr(args, "schedule"):
        schedule = schedule_arg(args.schedule)
        options = strategies.PipelineOptions(schedule, args.microbatches, args.virtual, args.layers_per_stage)
    subnet = None
    if hasattr(args, "coverage"):
        subnet = strategies.SubnetOptions(args.coverage, args.granularity, args.masking, args.seed)
    plan = strategies.from_names(
        strategy,
        dict(mesh.shape),
        context=context,
        pipeline_options=options,
        subnet_options=subnet,
        context_options=context_options(args),
        block=getattr(args, "block", None),
    )
    if getattr(args, "precision", "fp32") == "bf16":
        plan = plan + strategies.mixed_precision(compute="bfloat16", params="float32", gather="bfloat16")
    state = [part for part in getattr(args, "offload", None) or () if part != "activations"]
    return plan + strategies.offload(*state) if state else plan


def context_options(args: argparse.Namespace) -> strategies.ContextOptions | None:
    """How ``cp`` splits the sequence, from the --cp-* flags (None where the command has none).

    >>> context_options(argparse.Namespace(cp_method="ring", no_load_balance=False, cp_shard_params=True))
    ContextOptions(method='ring', load_balance=True, shard_params=True)
    """
    if not hasattr(args, "cp_method"):
        return None
    return strategies.ContextOptions(args.cp_method, not args.no_load_balance, args.cp_shard_params)


def _mesh(shape: dict[str, int], dcn: dict[str, int] | None, explicit: bool) -> jax.sharding.Mesh:
    if dcn is None:
        return spmd.make_mesh(shape, explicit=explicit)
    # What --dcn splits: slices on multi-slice TPU, else processes (as spmd.make_mesh groups devices).
    slices = len({getattr(d, "slice_index", None) for d in jax.devices()} - {None})
    granules = slices if slices > 1 else jax.process_count()
    if math.prod(dcn.values()) != granules:
        raise UsageError(
            f"--dcn {','.join(f'{a}={n}' for a, n in dcn.items())}: the axes span {math.prod(dcn.values())} "
            f"{'slices' if slices > 1 else 'processes'} between them, and this job has {granules}; give --dcn "
            f"sizes whose product is {granules}" + (", or leave --dcn out in a single process" if granules == 1 else "")
        )
    return spmd.make_mesh(shape, dcn=dcn, explicit=explicit)


def _dcn(args: argparse.Namespace) -> dict[str, int] | None:
    return spmd.parse_mesh(args.dcn) if getattr(args, "dcn", None) else None


def schedule_arg(value: str) -> str | Schedule:
    """A schedule name, or a table loaded from a .json/.csv file."""
    if value.endswith((".json", ".csv")):
        if not os.path.exists(value):
            raise UsageError(f"--schedule {value!r}: no such file")
        return Schedule.load(value)
    return value


def hardware_of(args: argparse.Namespace, profile: Profile | None = None, axes: Any = ()) -> costmodel.Hardware:
    """The cost model's device: --device-kind, else the kind of the devices present; the link bandwidths a device
    profile declares for the mesh ``axes`` on top, and --axis-bandwidth over those."""
    kind = getattr(args, "device_kind", None)
    if kind:
        hw = costmodel.hardware(kind)
    else:
        device = jax.devices()[0]
        hw = costmodel.detect(device.device_kind, device.platform)
    bandwidth = (profile.link_bandwidth(list(axes)) if profile is not None else {}) | dict(
        getattr(args, "axis_bandwidth", None) or {}
    )
    return hw.with_axis_bandwidth(bandwidth) if bandwidth else hw


def optimizer_of(args: argparse.Namespace) -> optax.GradientTransformation:
    # eps=1e-5 (Llama 2's AdamW) rather than optax's 1e-8. Adam's update g/(|g| + eps) moves by up to lr/eps per
    # unit of gradient, so for a gradient near zero the rounding of a reordered sum (a sharded reduction's) grows
    # lr/eps-fold each step, and feeds the next step's gradients: two steps of a batch of 2 (gpt-tiny, lr 3e-3)
    # differ from one device by 2.1e-4 on plain data=2 at eps 1e-6 and by 6.6e-6 at 1e-5, where --check can
    # tell noise from a bug again.
    return optax.adam(args.lr, eps=1e-5)


def profile_of(args: argparse.Namespace, devices: int) -> Profile | None:
    """The device profile the flags give, checked against the mesh's device count; None without one."""
    speeds, memory, path = (getattr(args, k, None) for k in ("device_speeds", "device_memory", "device_profile"))
    if path and (speeds or memory):
        raise UsageError("give either --device-profile or --device-speeds/--device-memory, not both")
    if path:
        profile = Profile.load(path)
    elif speeds or memory:
        values = _numbers(speeds, "--device-speeds") if speeds else [1.0] * devices
        sizes = [parse_bytes(m, "--device-memory") for m in memory.split(",")] if memory else None
        profile = Profile.from_speeds(values, sizes)
    else:
        return None
    try:
        return profile.check(devices)
    except ValueError as e:
        raise UsageError(f"{e} (the mesh has {devices} devices)") from None


def _numbers(text: str, flag: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",")]
    except ValueError:
        values = []
    if not values or any(not math.isfinite(v) or v <= 0 for v in values):
        raise UsageError(f"{flag} {text!r}: give one positive number per device, e.g. 3,3,1,1")
    return values
