"""Tessel's configuration: nested, validated dataclasses loaded from TOML presets and ``--set``.

    from engine.config import load_config
    cfg = load_config("tiny_llama_cpu", ["optim.lr=1e-3"])   # preset name or TOML path
    dp = cfg.validate_world(world_size)                      # resolves parallel.dp=-1
    cfg.to_json(os.path.join(cfg.train.run_dir, "config.json"))

Sections: model, parallel, train, optim, data, checkpoint, logging, fault (engine/config/sections.py),
posttrain with its nested lora and dpo tables (engine/config/posttrain.py);
the root and its cross-section checks: engine/config/schema.py; loading: engine/config/loader.py.
``python -m engine.config --config NAME --set k=v --world-size N`` prints the resolved config.
"""
from engine.config.loader import (add_config_args, apply_overrides, available_presets,
                                  config_from_args, configs_dir, load_config, resolve_preset)
from engine.config.posttrain import PosttrainConfig
from engine.config.schema import SECTIONS, TesselConfig
from engine.config.sections import (CheckpointConfig, DataConfig, FaultConfig, LoggingConfig, ModelConfig,
                                    OptimConfig, ParallelConfig, TrainConfig)

__all__ = [
    "CheckpointConfig", "DataConfig", "FaultConfig", "LoggingConfig", "ModelConfig", "OptimConfig",
    "ParallelConfig", "PosttrainConfig", "SECTIONS", "TesselConfig", "TrainConfig", "add_config_args",
    "apply_overrides", "available_presets", "config_from_args", "configs_dir", "load_config",
    "resolve_preset",
]
