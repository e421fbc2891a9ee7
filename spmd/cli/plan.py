"""``spmd plan``: how a plan lays out a model, and what the compiler makes of it (the report); a subnetwork plan
is measured against data parallelism on the same mesh."""

from __future__ import annotations

import argparse

import spmd
from spmd.cli import hetero
from spmd.cli.common import console, dumps
from spmd.cli.setup import setup
from spmd.execution import SubnetSpec

__all__ = ["command"]


def command(args: argparse.Namespace) -> int:
    s = setup(args)
    step = s.step()
    report = spmd.report(step, s.abstract_batch(), hardware=s.hardware)
    if isinstance(s.plan.execution, SubnetSpec):
        # What subnetworks save is measured against data parallelism for the same model, batch and mesh.
        data_parallel = s.step(plan=spmd.Plan(batch_axes=s.plan.batch_axes))
        report = report.with_data_parallel(spmd.report(data_parallel, s.abstract_batch(), hardware=s.hardware))
    info = hetero.figures(s, report, step) if s.profile is not None else {}
    if args.json:
        print(dumps({"model": s.model.name, **report.to_dict(), **info}))
        return 0
    console().print(report)
    if info:
        console().print(hetero.text(info))
    return 0
