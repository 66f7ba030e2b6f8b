"""The workload zoo: models, datasets with stateless batching, and job-arrival traces."""

from __future__ import annotations

from accelopt.workloads.data import (
    DATASET_NAMES,
    Dataset,
    build_dataset,
    check_compatible,
    default_dataset_for,
)
from accelopt.workloads.models import MODEL_NAMES, build_model, model_input_kind
from accelopt.workloads.trace import TraceJob, generate_trace

__all__ = [
    "DATASET_NAMES",
    "MODEL_NAMES",
    "Dataset",
    "TraceJob",
    "build_dataset",
    "build_model",
    "check_compatible",
    "default_dataset_for",
    "generate_trace",
    "model_input_kind",
]
