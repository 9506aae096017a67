"""Pipeline parallelism: schedules as data (actions, schedules), their validator (validate) and
timeline simulator (simulate); the zero-bubble schedules (zero_bubble: ZB-H1, ZB-V, DualPipeV). Pure Python, no torch: the runtime that executes one rank's action
list lives in parallel/pipeline/runtime.py and is imported on its own."""
from parallel.pipeline.actions import (ACTIVATION, BACKWARD, FORWARD, GRADIENT, RECV,
                                       SCHEDULE_NAMES, SEND, WEIGHT, Action, P2P, Schedule, ScheduleError)
from parallel.pipeline.schedules import (build_schedule, check_interleaved_args, forward_only, gpipe,
                                         interleaved_1f1b, interleaved_table, interleaved_warmup,
                                         one_f_one_b)
from parallel.pipeline.simulate import Simulation, TimelineEntry, peak_inflight, simulate
from parallel.pipeline.validate import validate
from parallel.pipeline.zero_bubble import dualpipev, zb_h1, zbv

__all__ = [
    "ACTIVATION", "BACKWARD", "FORWARD", "GRADIENT", "RECV", "SEND", "WEIGHT", "SCHEDULE_NAMES", "Action",
    "P2P", "Schedule", "ScheduleError", "Simulation", "TimelineEntry", "build_schedule",
    "check_interleaved_args", "forward_only", "gpipe", "interleaved_1f1b", "interleaved_table",
    "interleaved_warmup", "one_f_one_b", "peak_inflight", "simulate", "validate", "zb_h1", "zbv", "dualpipev",
]
