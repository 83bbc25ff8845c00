"""The RLTrainingJob API types, the CRD generated from them, and manifest validation."""

from kuberl.api.types import (
    API_VERSION,
    GROUP,
    KIND,
    PLURAL,
    VERSION,
    RLTrainingJob,
    RLTrainingJobSpec,
    RLTrainingJobStatus,
)

__all__ = ["API_VERSION", "GROUP", "KIND", "PLURAL", "VERSION", "RLTrainingJob", "RLTrainingJobSpec",
           "RLTrainingJobStatus"]
