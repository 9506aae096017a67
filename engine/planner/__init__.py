"""The layout planner (docs/planner.md): memory per GPU, step time, TFLOP/s and MFU of every legal
parallel layout of a model on a cluster, on the formulas Tessel's tests assert (engine/memory.py,
parallel/comm.py's byte table, parallel/pipeline's schedules and simulator).

* hardware: the GPU table with sources; model: the model from a preset, config.json or dimensions;
* predict: one layout; enumerate: every legal layout, ranked, pins checked; validate: published runs;
* calibrate: this machine's rates and the tiny preset's predicted-vs-measured runs (tools/plan.py).
"""
from engine.planner.enumerate import candidates, check_pins, plan, smallest_fit
from engine.planner.hardware import GPU, GPUS, fp8_gpus, gpu
from engine.planner.model import PlanModel, from_dims, from_hf_config, from_preset
from engine.planner.predict import Cluster, Layout, Prediction, Training, predict

__all__ = ["GPU", "GPUS", "Cluster", "Layout", "PlanModel", "Prediction", "Training", "candidates", "check_pins",
           "fp8_gpus", "from_dims", "from_hf_config", "from_preset", "gpu", "plan", "predict", "smallest_fit"]
