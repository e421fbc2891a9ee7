"""spmd: partitioning plans over logical device meshes for JAX/Flax, and a report of what the compiler made.

The core is here: meshes, plans and their layouts, the training step, the report, checkpoints, and the
activation constraints model code uses. What a strategy author builds on has its own namespace:
:mod:`spmd.rules` (the parts of a plan), :mod:`spmd.execution` (the execution seam and its modes),
:mod:`spmd.pipeline` (schedules, their simulation and Gantt charts), :mod:`spmd.collectives` (uneven
collectives), :mod:`spmd.devices` (emulated and heterogeneous devices), :mod:`spmd.axes` (logical axis names),
:mod:`spmd.costmodel`; :mod:`spmd.models` and :mod:`spmd.data` give models and data to try it on.

>>> import spmd
>>> mesh = spmd.make_mesh({"data": -1})
>>> spmd.Plan(batch_axes=("data",)).batch_spec()
P('data', None)
"""

from spmd import axes, collectives, costmodel, devices, execution, pipeline, rules
from spmd._checkpoint import CheckpointError, Checkpoints, ModelLayout
from spmd._context import activate, constrain
from spmd._context_attention import attention, balance_sequence, restore_sequence, sequence_positions
from spmd._create import create
from spmd._devices import emulate_devices
from spmd._feed import global_batch
from spmd._format import format_bytes
from spmd._launch import initialize
from spmd._layout import Layout, LeafLayout, StateLayout, resolve_state
from spmd._mesh import make_mesh, parse_mesh
from spmd._plan import Plan
from spmd._precision import Precision, master_weights
from spmd._remat import Remat, rematerialise
from spmd._report import Report, report
from spmd._resolve import PlanWarning
from spmd._rules import PlanError
from spmd._tensor_shares import unit_sum
from spmd._train import TrainState, TrainStep, shard
from spmd._tree import unbox

__all__ = [
    "CheckpointError",
    "Checkpoints",
    "Layout",
    "LeafLayout",
    "ModelLayout",
    "Plan",
    "PlanError",
    "PlanWarning",
    "Precision",
    "Remat",
    "Report",
    "StateLayout",
    "TrainState",
    "TrainStep",
    "activate",
    "attention",
    "axes",
    "balance_sequence",
    "collectives",
    "constrain",
    "create",
    "costmodel",
    "devices",
    "emulate_devices",
    "execution",
    "format_bytes",
    "global_batch",
    "initialize",
    "make_mesh",
    "master_weights",
    "parse_mesh",
    "pipeline",
    "rematerialise",
    "report",
    "resolve_state",
    "restore_sequence",
    "rules",
    "sequence_positions",
    "shard",
    "unbox",
    "unit_sum",
]
__version__ = "0.1.0"
