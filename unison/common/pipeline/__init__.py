"""Pipeline parallelism without a framework: schedules as data, checked, simulated and drawn.

``build_schedule`` makes a per-rank table of compute actions, ``validate`` proves it runs,
``simulate`` times it, ``render_text``/``render_png`` draw it and ``balance_by_cost`` cuts a
model into stages. ``PipelineDriver`` runs a table across MPI ranks with a framework's
``StageWorker``; the PyTorch and Keras executors are such workers. See docs/pipeline.md.
"""

from unison.common.pipeline.builders import build_schedule
from unison.common.pipeline.driver import (
    PipelineDriver,
    PipelineError,
    RemoteTraceback,
    StageWorker,
    StepStats,
    raise_together,
)
from unison.common.pipeline.partition import balance_by_cost, check_balance
from unison.common.pipeline.render import render_png, render_text
from unison.common.pipeline.schedule import COMM_OPS, COMPUTE_OPS, SCHEDULES, Action, Schedule, ScheduleError
from unison.common.pipeline.simulate import Event, SimResult, compare_schedules, simulate
from unison.common.pipeline.validate import render_grid, validate

__all__ = [
    "SCHEDULES", "COMPUTE_OPS", "COMM_OPS", "ScheduleError", "Action", "Schedule", "build_schedule",
    "validate", "render_grid", "simulate", "compare_schedules", "SimResult", "Event", "render_text",
    "render_png", "balance_by_cost", "check_balance", "PipelineDriver", "PipelineError", "StageWorker",
    "StepStats", "RemoteTraceback", "raise_together",
]
