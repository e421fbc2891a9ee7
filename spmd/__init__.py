"""spmd: partitioning plans over logical device meshes for JAX/Flax, and a report of what the compiler made.

>>> import spmd
>>> mesh = spmd.make_mesh({"data": -1})
>>> spmd.Plan(batch_axes=("data",)).batch_spec()
P('data', None)
"""

from spmd._context import activate, constrain
from spmd._devices import emulate_devices
from spmd._mesh import make_mesh, parse_mesh
from spmd._plan import Layout, LeafLayout, Plan, PlanError, PlanWarning
from spmd._report import Report, format_bytes, report
from spmd._train import StateLayout, TrainState, TrainStep, resolve_state, shard, train_step
from spmd._tree import unbox

__all__ = [
    "Layout",
    "LeafLayout",
    "Plan",
    "PlanError",
    "PlanWarning",
    "Report",
    "StateLayout",
    "TrainState",
    "TrainStep",
    "activate",
    "constrain",
    "emulate_devices",
    "format_bytes",
    "make_mesh",
    "parse_mesh",
    "report",
    "resolve_state",
    "shard",
    "train_step",
    "unbox",
]
__version__ = "0.1.0"
