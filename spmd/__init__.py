"""spmd: partitioning plans over logical device meshes for JAX/Flax, and a report of what the compiler made.

>>> import spmd
>>> mesh = spmd.make_mesh({"data": -1})
>>> spmd.Plan(batch_axes=("data",)).batch_spec()
P('data', None)
"""

from spmd._checkpoint import CheckpointError, Checkpoints
from spmd._context import activate, constrain
from spmd._devices import emulate_devices
from spmd._gantt import gantt_text, plot_gantt
from spmd._mesh import make_mesh, parse_mesh
from spmd._pipeline import Pipeline, StagedModel
from spmd._plan import Layout, LeafLayout, Plan, PlanError, PlanWarning
from spmd._profile import Device, Profile
from spmd._report import Report, format_bytes, report
from spmd._schedule import Action, Costs, PipelineSpec, Schedule, ScheduleError, Timeline, simulate, validate
from spmd._shares import Shares, UnevenData
from spmd._subnet import Ownership, SubnetSpec, Subnetworks
from spmd._train import StateLayout, TrainState, TrainStep, resolve_state, shard, train_step
from spmd._tree import unbox
from spmd._uneven import padded_all_gather, padded_reduce_scatter, uneven_all_to_all

__all__ = [
    "Action",
    "CheckpointError",
    "Checkpoints",
    "Costs",
    "Device",
    "Layout",
    "Ownership",
    "LeafLayout",
    "Plan",
    "PlanError",
    "Pipeline",
    "PipelineSpec",
    "PlanWarning",
    "Profile",
    "Report",
    "Schedule",
    "ScheduleError",
    "Shares",
    "StagedModel",
    "SubnetSpec",
    "Subnetworks",
    "StateLayout",
    "TrainState",
    "Timeline",
    "TrainStep",
    "UnevenData",
    "activate",
    "constrain",
    "emulate_devices",
    "format_bytes",
    "gantt_text",
    "make_mesh",
    "padded_all_gather",
    "padded_reduce_scatter",
    "parse_mesh",
    "plot_gantt",
    "report",
    "resolve_state",
    "shard",
    "simulate",
    "train_step",
    "unbox",
    "uneven_all_to_all",
    "validate",
]
__version__ = "0.1.0"
