"""The run configuration (layer L0): what a run is, checked before anything starts.

- sections.py  one dataclass per concern (model, data, train, parallel, checkpoint, log) composed into RootConfig;
               standard library only
- manifest.py  the data manifest's SourceConfig / ManifestConfig (`megagenome prepare`); standard library only
- record.py    what a checkpoint records of the config (resume_record, config_hash) and what a resume may change
- shapes.py    family-neutral shape rules: the default d_ff, the published options and their checks
- checks.py    static validation of a config or a manifest: every problem at once, each naming its flag
- load.py      YAML files + command-line flags -> RootConfig through jsonargparse (imported on demand: it is the
               one module here with a third-party import)

The names most code needs are importable from `megagenome.config` itself.
"""

from megagenome.config.checks import ConfigError, signal_number, validate, validate_manifest
from megagenome.config.manifest import ManifestConfig, SourceConfig
from megagenome.config.record import config_differences, config_hash, resume_record
from megagenome.config.sections import (
    CheckpointConfig,
    DataConfig,
    LogConfig,
    ModelConfig,
    ParallelConfig,
    Region,
    RootConfig,
    TrainConfig,
    parse_region,
    to_dict,
)
from megagenome.config.shapes import d_ff

__all__ = [
    "CheckpointConfig",
    "ConfigError",
    "DataConfig",
    "LogConfig",
    "ManifestConfig",
    "ModelConfig",
    "ParallelConfig",
    "Region",
    "RootConfig",
    "SourceConfig",
    "TrainConfig",
    "config_differences",
    "config_hash",
    "d_ff",
    "parse_region",
    "resume_record",
    "signal_number",
    "to_dict",
    "validate",
    "validate_manifest",
]
