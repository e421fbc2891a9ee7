"""Pipeline parallelism: schedules as data (the IR a strategy writes), their simulation and Gantt charts, the
engine that runs any valid schedule inside one SPMD program, and a model's cut into stages from its parts.

>>> from spmd import pipeline
>>> s = pipeline.Schedule("mine", 2, (("F0", "F1", "BW0", "BW1"), ("F0", "BW0", "F1", "BW1")))
>>> pipeline.simulate(s).bubble_fraction  # exact: device 1 waits for F0, device 0 for BW0
Fraction(1, 3)
"""

from spmd._gantt import COLORS, gantt_text, plot_gantt
from spmd._pipeline import TICK_SCOPE, Pipeline, StagedModel, TickProgram, pipeline_executor, split_layers, tick_program
from spmd._schedule import (
    KINDS,
    PLACEMENTS,
    Action,
    Costs,
    Schedule,
    ScheduleError,
    Timeline,
    simulate,
    simulate_lockstep,
    tick_table,
    validate,
)
from spmd._specs import PipelineSpec
from spmd._staging import staged_from_parts, staged_loss

__all__ = [
    "COLORS",
    "KINDS",
    "PLACEMENTS",
    "TICK_SCOPE",
    "Action",
    "Costs",
    "Pipeline",
    "PipelineSpec",
    "Schedule",
    "ScheduleError",
    "StagedModel",
    "TickProgram",
    "Timeline",
    "gantt_text",
    "pipeline_executor",
    "plot_gantt",
    "simulate",
    "simulate_lockstep",
    "split_layers",
    "staged_from_parts",
    "staged_loss",
    "tick_program",
    "tick_table",
    "validate",
]
