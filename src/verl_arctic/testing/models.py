"""The request bodies Arctic's server validates, declared as Arctic declares them.

FastAPI answers a body that fails these models with 422 and pydantic's error
list before the handler runs (so a refused ``/initialize`` uses no job id).
Fields, types and defaults follow arctic-platform 0.1.2
``rl/utils/server_models.py`` (generation v0.1) and 0.1.4
``common/utils/server_models.py`` (main).
"""

from __future__ import annotations

from collections.abc import Mapping
from numbers import Integral
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

__all__ = [
    "GenerateRequest",
    "GenerateRequestMain",
    "JobConfig",
    "JobConfigMain",
    "LoadCheckpointRequest",
    "LogProbsRequest",
    "ModelConfig",
    "OperationRequest",
    "ResetPrefixCacheRequest",
    "SaveRequest",
    "StepRequest",
    "SyncWeightsRequest",
    "WeightNormRequest",
    "WeightSyncRequest",
    "resolve_sp_size",
]


class JobConfig(BaseModel):
    """v0.1's ``/initialize`` body (rl/utils/server_models.py:28-42); unknown keys are ignored."""

    model_config = ConfigDict(extra="ignore")

    model_name: str
    job_type: str = Field(default="training")
    num_devices: int | None = None
    ds_config: dict[str, Any] | None = None
    training_config: dict[str, Any] | None = None
    log_prob_config: dict[str, Any] | None = None
    ds_worker_config: dict[str, Any] | None = None
    vllm_config: dict[str, Any] | None = None
    checkpoint_path: str | None = None
    arctic_inference_config: dict[str, Any] | None = None
    full_determinism: bool = False
    seed: int = 42


# -- main's sequence-parallel degree (common/utils/server_models.py:16-120) -------------------------

_DS_WORKER_SP = (
    ("ds_worker_config", "sequence_parallel"),
    ("ds_worker_config", "sequence_parallel_size"),
    ("ds_worker_config", "parallelism", "sequence_parallel"),
)
_TRAINING_SP = (("training_config", "sp_size"), ("ds_config", "sequence_parallel_size"))
_LOG_PROB_SP = ("log_prob_config", "sequence_parallel_size")
_DS_CONFIG_SP = ("ds_config", "sequence_parallel_size")


def _nested(mapping: Mapping[str, Any], path: tuple[str, ...]) -> Any:
    node: Any = mapping
    for part in path:
        node = node.get(part) if isinstance(node, dict) else None
        if node is None:
            return None
    return node


def _degree(value: Any, name: str) -> int:
    if value is None:
        return 1
    if isinstance(value, bool) or not isinstance(value, Integral) or int(value) < 1:
        raise ValueError(f"{name} must be an integer >= 1 (1 = disabled); got {value!r}")
    return int(value)


def resolve_sp_size(job: Mapping[str, Any]) -> int:
    """The job's sequence-parallel degree; disagreeing sources are a ValueError (a 422 at validation)."""
    job_type = job.get("job_type") or "training"
    if job_type == "log_prob":
        if _nested(job, _LOG_PROB_SP) is not None:
            paths: tuple[tuple[str, ...], ...] = (_LOG_PROB_SP, *_DS_WORKER_SP)
        else:
            paths = (_DS_CONFIG_SP, _LOG_PROB_SP, *_DS_WORKER_SP)
    elif job_type == "sampling":
        paths = _DS_WORKER_SP
    else:
        paths = (*_TRAINING_SP, *_DS_WORKER_SP)
    found = {".".join(p): _degree(_nested(job, p), p[-1]) for p in paths if _nested(job, p) is not None}
    if len(set(found.values())) > 1:
        raise ValueError(f"conflicting sequence-parallel degrees: {found}")
    return next(iter(found.values()), 1)


class JobConfigMain(JobConfig):
    """main's ``/initialize`` body: v0.1's plus the weight-sync strategy, a null seed, the SP check."""

    cuda_ipc: bool = False
    low_memory: bool = False

    @field_validator("seed", mode="before")
    @classmethod
    def _null_seed(cls, value: Any) -> Any:
        return 42 if value is None else value

    @model_validator(mode="after")
    def _sp_size(self) -> JobConfigMain:
        resolve_sp_size(self.model_dump())
        return self

    @property
    def sp_size(self) -> int:
        return resolve_sp_size(self.model_dump())


class GenerateRequest(BaseModel):
    prompts: list[str]
    sampling_params: dict[str, Any] | None = None


class GenerateRequestMain(GenerateRequest):
    routing_key: Any = None
    strict: bool = False


class LogProbsRequest(BaseModel):
    prompts: list[str]
    completions: list[str] | None = None
    top_k: int = 1


class SyncWeightsRequest(BaseModel):
    training_job_id: int
    sampling_job_id: int
    colocate: bool = False
    cuda_ipc: bool = False
    low_memory: bool = False


class WeightNormRequest(BaseModel):
    training_job_id: int
    sampling_job_id: int


class StepRequest(BaseModel):
    learning_rate: float | None = None


class SaveRequest(BaseModel):
    checkpoint_id: str | None = None
    checkpoint_type: str = "resumable"
    path: str | None = None
    step: int | None = None
    export_hf: bool = False
    save_total_limit: int | None = None
    stage_info: dict[str, Any] | None = None


class LoadCheckpointRequest(BaseModel):
    path: str | None = None
    step: int | None = None


class ResetPrefixCacheRequest(BaseModel):
    drain: bool = True
    timeout_s: float = 60.0
    retry_interval_s: float = 0.1


class WeightSyncRequest(BaseModel):
    source_sub_job_id: int
    target_sub_job_ids: list[int]
    cuda_ipc: bool | None = None
    low_memory: bool | None = None


class OperationRequest(BaseModel):
    operation_type: str
    sub_job_id: int | str | None = None
    sub_job_type: str | None = None
    payload: dict[str, Any] = Field(default_factory=dict)


class ModelConfig(BaseModel):
    """arctic-inference's vLLM ``ModelConfig`` fields (0.2.0 and 0.3.0 server/config.py).

    Built inside ``/initialize`` from ``vllm_config`` (``build_model_config``), so a
    field of the wrong type fails there: a 500, not a 422.
    """

    model: str
    tensor_parallel_size: int = 1
    max_model_len: int = 32768
    max_num_seqs: int = 1024
    gpu_memory_utilization: float = 0.95
    quantization: str | None = None
    enable_chunked_prefill: bool = True
    kv_cache_dtype: str | None = None
    enable_expert_parallel: bool = False
    trust_remote_code: bool = True
    use_fca: bool = False
    spec_model: str = ""
