"""``spmd run``: train with a plan, optionally checked against one device, checkpointed and resumed."""

from __future__ import annotations

import argparse
from typing import Any

import jax

from spmd import costmodel
from spmd.cli.common import console, dumps
from spmd.cli.setup import setup
from spmd.cli.train import bf16_check, max_abs_diff, reference, train
from spmd.execution import PipelineSpec, Shares, TensorShares

__all__ = ["command"]


def command(args: argparse.Namespace) -> int:
    s = setup(args)
    run = train(s, args, label=args.strategy, quiet=args.json)
    out: dict[str, Any] = {
        "model": s.model.name,
        "mesh": dict(s.mesh.shape),
        "processes": jax.process_count(),
        "strategy": args.strategy,
        "axis_types": s.mesh.axis_types[0].name.lower(),
        "plan": run.step.plan_carried_out(s.abstract_batch()).describe(),  # no remat claimed where none is applied
        "losses": run.losses,
        "per_device_bytes": costmodel.model_state_bytes(run.step.layout, s.plan.precision),
    }
    spec = s.plan.execution
    if isinstance(spec, Shares):
        out["batch_shares"] = list(spec.shares)
    if isinstance(spec, PipelineSpec):
        out["layers_per_stage"] = list(spec.layers_per_stage or ())
        if spec.data_schedules:
            out["rank_microbatches"] = list(spec.rank_microbatches)
    if isinstance(spec, TensorShares):
        out["tensor_units"] = {n: list(spec.of(n)) for n in spec.names}
    if args.on_nan == "skip":
        out["skipped_steps"] = list(run.skipped)
    if args.checkpoint_dir:
        out["checkpoint_step"] = args.steps
    if args.check and jax.process_index() == 0:  # one device of the first process is the reference
        ref = reference(s, args, quiet=args.json)
        out["reference_losses"] = ref.losses
        out["max_abs_diff"] = max_abs_diff(run, ref)
        if s.plan.precision is not None:
            out["bf16_check"] = bf16_check(run, ref, args.lr)
    if args.json:
        print(dumps(out))
        return 0
    c = console()
    c.print(f"losses: {' '.join(f'{x:.4f}' for x in run.losses)}")
    if run.skipped:
        c.print(f"skipped (non-finite loss, state kept): steps {', '.join(map(str, run.skipped))}")
    if "max_abs_diff" in out:
        c.print(f"one device: {' '.join(f'{x:.4f}' for x in out['reference_losses'])}")
        c.print(f"max |difference| over losses and parameters: {out['max_abs_diff']:.2e}")
    if "bf16_check" in out:
        b = out["bf16_check"]
        c.print(
            f"bf16 check {'passed' if b['passed'] else 'FAILED'}: losses within {b['loss_rel_diff']:.1e} relative "
            f"(tolerance 2^-8), parameters within {b['param_abs_diff']:.1e} (tolerance 2·lr·steps)"
        )
    return 0
