"""The public vocabulary shared by the SDK, the coordinator and the workers: one import for all of it.

Names and fields follow the Tinker SDK (`tinker.types`) so that a training loop written for Tinker ports by
changing the import. Everything here is a plain dataclass over numpy arrays: no torch import at module load,
no pydantic, and every type crosses the wire through `bios.transport.codec`.

This module is a facade by design: it defines nothing and only re-exports, so `from bios import types as t`
(and the SDK's users) see one flat namespace as `tinker.types` does, while each part of the vocabulary lives in
the module for its job: `tensors` (`TensorData`), `training` (data, losses, LoRA, optimizers and their
results), `sampling` (sampling params and results), `runs` (runs, checkpoints, base models) and
`bios.model_input` (the chunks a model reads).
"""

from bios.model_input import (
    EncodedTextChunk,
    ImageAssetPointerChunk,
    ImageChunk,
    ModelInput,
    ModelInputChunk,
)

from .runs import (
    BaseModelInfo,
    Checkpoint,
    CheckpointsListResponse,
    Cursor,
    GetInfoResponse,
    GetServerCapabilitiesResponse,
    LoadWeightsResponse,
    LoraTargetGroup,
    ModelData,
    SaveWeightsForSamplerResponse,
    SaveWeightsResponse,
    SupportedModel,
    TrainingRun,
    TrainingRunsResponse,
)
from .sampling import (
    TOPK_MASK_LOGPROB,
    PromptAltTokens,
    SampledSequence,
    SampleResponse,
    SamplingParams,
    StopReason,
    TopkLogprobs,
)
from .tensors import TensorData, TensorDtype
from .training import (
    LOSS_FNS,
    AdamOptimizerConfig,
    AdamParams,
    CustomLoss,
    CustomLossInput,
    CustomLossNode,
    Datum,
    DimuonOptimizerConfig,
    DimuonParams,
    ForwardBackwardOutput,
    LoraConfig,
    LossFnType,
    OptimizerName,
    OptimStepResponse,
)

__all__ = [
    # bios.model_input
    "EncodedTextChunk", "ImageAssetPointerChunk", "ImageChunk", "ModelInput", "ModelInputChunk",
    # .tensors
    "TensorData", "TensorDtype",
    # .training
    "LOSS_FNS", "AdamOptimizerConfig", "AdamParams", "CustomLoss", "CustomLossInput", "CustomLossNode", "Datum",
    "DimuonOptimizerConfig", "DimuonParams", "ForwardBackwardOutput", "LoraConfig", "LossFnType", "OptimizerName",
    "OptimStepResponse",
    # .sampling
    "TOPK_MASK_LOGPROB", "PromptAltTokens", "SampledSequence", "SampleResponse", "SamplingParams", "StopReason",
    "TopkLogprobs",
    # .runs
    "BaseModelInfo", "Checkpoint", "CheckpointsListResponse", "Cursor", "GetInfoResponse",
    "GetServerCapabilitiesResponse", "LoadWeightsResponse", "LoraTargetGroup", "ModelData",
    "SaveWeightsForSamplerResponse", "SaveWeightsResponse", "SupportedModel", "TrainingRun", "TrainingRunsResponse",
]
