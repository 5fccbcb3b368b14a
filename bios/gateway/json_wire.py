"""JSON on the Tinker wire: request bodies into Bios messages, Bios results into the shapes the SDK validates.

The SDK validates replies strictly (pydantic), so every shape here follows `tinker.types` field for field:
literal `type` values are exact or absent, datetimes are ISO 8601, checkpoint paths are `tinker://`. Request
fields are read leniently (unknown ones are ignored, so newer clients keep working) but typed strictly: a
missing or mistyped field is a BadRequestError naming it. Bodies are read through `json_body.Body`; the
`tinker.types` values inside them (model inputs, sampling params, target ids) through `json_types`.
"""

from __future__ import annotations

import dataclasses
from datetime import datetime, timezone
from typing import Any

from bios import messages as m
from bios import types as t
from bios.account import check_user_metadata
from bios.checkpoint_path import CheckpointPath
from bios.exceptions import ERROR_TYPES, BadRequestError, RemoteError

from .json_body import Body
from .json_types import model_input, sampling_params, target_ids

# Reductions the SDK's chunk combiner knows; a metric with any other suffix is dropped by the client.
REDUCTIONS = frozenset({"mean", "sum", "min", "max", "slack", "hash2", "unique"})


# ------------------------------------------------------------------------------------------ requests


def create_model(body: Body) -> m.CreateModel:
    optimizer = _optimizer(body)
    lora = body.child("lora_config", None)
    config = t.LoraConfig() if lora is None else t.LoraConfig(
        rank=lora.integer("rank", 32),
        seed=lora.integer("seed", None),
        train_unembed=lora.flag("train_unembed", True),
        train_mlp=lora.flag("train_mlp", True),
        train_attn=lora.flag("train_attn", True),
    )
    return m.CreateModel(body.text("session_id"), _model_seq_id(body), body.text("base_model"), config,
                         optimizer=optimizer, user_metadata=_user_metadata(body))


def _user_metadata(body: Body) -> dict[str, str] | None:
    """A request's `user_metadata` (kept with the run or checkpoint it creates), checked."""
    return check_user_metadata(body.data.get("user_metadata"), body._field("user_metadata"))


def _model_seq_id(body: Body) -> int:
    """The per-session counter that names the run `{session_id}:train:{model_seq_id}`."""
    model_seq_id = body.integer("model_seq_id")
    if model_seq_id < 0:
        raise BadRequestError(f"model_seq_id must be >= 0, got {model_seq_id}", field="model_seq_id")
    return model_seq_id


def _optimizer(body: Body) -> t.OptimizerName:
    """The run's optimizer from `optimizer_config`: AdamW (absent or `adamw`) or Dimuon version 1."""
    config = body.child("optimizer_config", None)
    kind = "adamw" if config is None else config.text("type", "adamw")
    if kind == "dimuon" and config.integer("version", 1) != 1:
        raise BadRequestError(f"optimizer_config.version {config.data['version']!r} is not supported: Bios runs "
                              "Dimuon version 1", field="optimizer_config.version")
    if kind not in ("adamw", "dimuon"):
        raise BadRequestError(f"optimizer_config.type {kind!r} is not supported: Bios trains with adamw or dimuon",
                              field="optimizer_config.type")
    return kind


def load_weights(body: Body) -> m.LoadWeights | m.CreateModel:
    """`model_id` + `seq_id`: load into a run. `session_id` + `model_seq_id`: a new run from the checkpoint."""
    path, optimizer = body.text("path"), body.flag("optimizer", False)
    if body.data.get("session_id") is not None:  # with the optimizer state, the checkpoint's optimizer wins
        return m.CreateModel(body.text("session_id"), _model_seq_id(body), body.text("base_model", ""),
                             t.LoraConfig(), from_path=path, with_optimizer=optimizer, optimizer=_optimizer(body),
                             user_metadata=_user_metadata(body))
    if body.data.get("model_id") is None:
        raise BadRequestError("load_weights needs model_id and seq_id (load into a run) or session_id and "
                              "model_seq_id (a new run from the checkpoint)", field="model_id")
    return m.LoadWeights(body.text("model_id"), _seq_id(body), path, optimizer)


def _seq_id(body: Body) -> int:
    seq_id = body.integer("seq_id")
    if seq_id < 1:
        raise BadRequestError(f"seq_id must be >= 1 (the first request after create_model is 1), got {seq_id}",
                              field="seq_id")
    return seq_id


def optim_step(body: Body) -> m.OptimStep:
    name = next((n for n in ("adam_params", "optim_params", "optimizer_params") if body.data.get(n) is not None),
                "adam_params")
    params = body.child(name)
    kind = params.text("type", "adam")
    if kind == "dimuon":
        defaults = t.DimuonParams(learning_rate=0.0)
        dimuon = t.DimuonParams(
            learning_rate=params.number("learning_rate"),
            **{name: params.number(name, getattr(defaults, name))
               for name in ("grad_clip_norm", "beta1", "damping", "rank_lr_correction_exponent")},
        )
        return m.OptimStep(body.text("model_id"), _seq_id(body), dimuon)
    if kind not in ("adam", "adamw"):
        raise BadRequestError(f"{name}.type {kind!r} is not supported: Bios trains with adamw or dimuon",
                              field=f"{name}.type")
    defaults = t.AdamParams()
    adam = t.AdamParams(
        learning_rate=params.number("learning_rate", defaults.learning_rate),
        beta1=params.number("beta1", defaults.beta1),
        beta2=params.number("beta2", defaults.beta2),
        eps=params.number("eps", defaults.eps),
        weight_decay=params.number("weight_decay", defaults.weight_decay),
        grad_clip_norm=params.number("grad_clip_norm", defaults.grad_clip_norm),
    )
    return m.OptimStep(body.text("model_id"), _seq_id(body), adam)


def save_weights(body: Body) -> m.SaveWeights:
    return m.SaveWeights(body.text("model_id"), _seq_id(body), body.text("path"), "weights",
                         overwrite=body.flag("overwrite", False), user_metadata=_user_metadata(body))


def save_weights_external(body: Body) -> m.SaveWeights:
    """An external save is the adapter alone (safetensors under PEFT key names, plus metadata.json) at
    `.../external_weights/<name>`, for download; encrypting it (`age_encryption_recipients`) is refused."""
    if body.data.get("age_encryption_recipients"):
        raise BadRequestError("Bios does not encrypt exported weights (age_encryption_recipients); save without it "
                              "and encrypt the downloaded files", field="age_encryption_recipients")
    return m.SaveWeights(body.text("model_id"), _seq_id(body), body.text("path"), "external_weights")


def save_weights_for_sampler(body: Body) -> tuple[m.SaveWeights, int | None]:
    """A named save (`path`), or an unnamed one whose result opens sampling session `sampling_session_seq_id`."""
    name = body.text("path", None)
    sampling_seq = body.integer("sampling_session_seq_id", None)
    if name is None and sampling_seq is None:
        raise BadRequestError("save_weights_for_sampler needs a path (a checkpoint name) or a "
                              "sampling_session_seq_id", field="path")
    op = m.SaveWeights(body.text("model_id"), _seq_id(body), name, "sampler_weights",
                       user_metadata=_user_metadata(body))
    return op, None if name is not None else sampling_seq


def create_sampling_session(body: Body) -> m.CreateSamplingSession:
    return m.CreateSamplingSession(body.text("session_id"), body.integer("sampling_session_seq_id"),
                                   body.text("base_model", None), body.text("model_path", None))


def sample(body: Body) -> tuple[m.Sample, int | None]:
    """An asample request and its `prompt_logprobs_last_n`; what Bios cannot compute is refused, not ignored."""
    sampling_session_id = body.text("sampling_session_id", None)
    if sampling_session_id is None:
        raise BadRequestError("sampling_session_id is required: create one with create_sampling_session",
                              field="sampling_session_id")
    prompt_logprobs = body.flag("prompt_logprobs", False)
    last_n = body.integer("prompt_logprobs_last_n", None)
    if last_n is not None and (last_n < 1 or not prompt_logprobs):
        raise BadRequestError("prompt_logprobs_last_n must be >= 1 and needs prompt_logprobs",
                              field="prompt_logprobs_last_n")
    op = m.Sample(
        sampling_session_id=sampling_session_id,
        seq_id=body.integer("seq_id"),
        prompt=model_input(body.child("prompt")),
        num_samples=body.integer("num_samples", 1),
        sampling_params=sampling_params(body.child("sampling_params")),
        prompt_logprobs=prompt_logprobs,
        topk_prompt_logprobs=body.integer("topk_prompt_logprobs", 0),
        prompt_alt_tokens_k=body.integer("prompt_alt_tokens_k", 0),
        topk_sample_logprobs=body.integer("topk_sample_logprobs", 0),
        target_prompt_logprobs=target_ids(body.child("target_prompt_logprobs", None)),
    )
    return op, last_n


# ------------------------------------------------------------------------------------------ results


def tinker_path(path: str | None) -> str | None:
    """`bios://run/kind/name` as the `tinker://run/kind/name` Tinker clients expect."""
    return None if path is None else f"tinker://{path.partition('://')[2]}"


def tinker_metrics(metrics: dict[str, float] | None) -> dict[str, float]:
    """Every key as `name:reduction` with exactly one colon and a reduction the SDK combines (else `:mean`)."""
    out: dict[str, float] = {}
    for key, value in (metrics or {}).items():
        name, _, reduction = key.rpartition(":")
        if not name or reduction not in REDUCTIONS:
            name, reduction = key, "mean"
        out[f"{name.replace(':', '_')}:{reduction}"] = float(value)
    return out


def failure(error: RemoteError) -> dict[str, str]:
    """An async failure as retrieve_future reports it: the SDK raises RequestFailedError with this message."""
    category = ERROR_TYPES.get(error.type, ERROR_TYPES["InternalServerError"]).category
    message = error.message if error.field is None else f"{error.message} (field: {error.field})"
    return {"error": message, "category": "user" if category == "user" else "server"}


def _time(value: float) -> str:
    return datetime.fromtimestamp(value, timezone.utc).isoformat()


def optimizer_config(optimizer: t.OptimizerName) -> dict[str, Any]:
    """A run's optimizer as Tinker's `optimizer_config`."""
    return {"type": "dimuon", "version": 1} if optimizer == "dimuon" else {"type": "adamw"}


def get_info(info: t.GetInfoResponse) -> dict[str, Any]:
    return {
        "type": "get_info",
        "model_id": info.model_id,
        "model_data": {"arch": info.model_data.arch, "model_name": info.model_data.model_name,
                       "tokenizer_id": info.model_data.tokenizer_id
                       or _builtin_tokenizer(info.model_data.model_name)},
        "optimizer_config": optimizer_config(info.optimizer),
        "is_lora": info.is_lora,
        "lora_rank": info.lora_rank,
        "model_name": info.model_name,
        # Bios's own: the tinker SDK's GetInfoResponse ignores fields it does not know (extra="ignore").
        "lora_targets": None if info.lora_targets is None else [dataclasses.asdict(g) for g in info.lora_targets],
    }


def _builtin_tokenizer(model_name: str | None) -> str | None:
    """For a run whose workers have not described its model (one restored from the state dir): a built-in's
    directory, for `TrainingClient.get_tokenizer()`; None otherwise (the SDK then loads the model name)."""
    if model_name is None:
        return None
    path = builtin_dir(model_name)
    return None if path == model_name else path


def checkpoint(ckpt: t.Checkpoint) -> dict[str, Any]:
    return {
        "checkpoint_id": ckpt.checkpoint_id,
        "checkpoint_type": ckpt.checkpoint_type,
        "time": _time(ckpt.time),
        "tinker_path": tinker_path(ckpt.bios_path),
        "size_bytes": ckpt.size_bytes,
        "public": False,
        "user_metadata": ckpt.user_metadata,
    }


def training_run(run: t.TrainingRun) -> dict[str, Any]:
    return {
        "training_run_id": run.training_run_id,
        "base_model": run.base_model,
        "model_owner": run.model_owner,
        "is_lora": run.is_lora,
        "corrupted": False,
        "lora_rank": run.lora_rank,
        "last_request_time": _time(run.last_request_time),
        "last_checkpoint": checkpoint(run.last_checkpoint) if run.last_checkpoint else None,
        "last_sampler_checkpoint": checkpoint(run.last_sampler_checkpoint) if run.last_sampler_checkpoint else None,
        "user_metadata": run.user_metadata,
    }


def training_runs(resp: t.TrainingRunsResponse) -> dict[str, Any]:
    cursor = resp.cursor
    return {"training_runs": [training_run(r) for r in resp.training_runs],
            "cursor": {"offset": cursor.offset, "limit": cursor.limit, "total_count": cursor.total_count}}


def weights_info(run: t.TrainingRun) -> dict[str, Any]:
    """What a checkpoint's run trains: base model, optimizer, LoRA rank and which weights (the `train_*` flags,
    as the run was created; None for a run that recorded none)."""
    lora = run.lora
    return {"base_model": run.base_model, "optimizer_config": optimizer_config(run.optimizer), "is_lora": True,
            "lora_rank": run.lora_rank,
            "train_unembed": lora.train_unembed if lora else None, "train_mlp": lora.train_mlp if lora else None,
            "train_attn": lora.train_attn if lora else None}


def sampler(session: m.SamplingSession) -> dict[str, Any]:
    """`GET /samplers/{id}`. The SDK's `SamplingClient.get_tokenizer()` loads its `base_model` with transformers
    and reads nothing else, so a built-in model, which no model hub has, is reported as its local directory."""
    return {"sampler_id": session.sampling_session_id, "base_model": builtin_dir(session.base_model),
            "model_path": tinker_path(session.model_path)}


def builtin_dir(base_model: str) -> str:
    """A built-in model (`bios/tiny-llama`...) as its directory in this host's model cache (where it is written on
    first use), which `AutoTokenizer.from_pretrained` loads offline; any other name unchanged (a hub name stays the
    name the cookbook looks renderers up by). The SDK cuts a name at its first `:` and one with exactly two `/` to
    `org/model`, so a directory with a `:` is not used and one with two `/` gets a trailing `/.`."""
    from bios.models.cache import model_dir_for
    from bios.models.registry import BUILTIN_NAMES, canonical_name

    name = canonical_name(base_model)
    path = str(model_dir_for(name))
    if name not in BUILTIN_NAMES or ":" in path:
        return base_model
    return f"{path}/." if path.count("/") == 2 else path


def capabilities(resp: t.GetServerCapabilitiesResponse) -> dict[str, Any]:
    return {"supported_models": [{"model_name": s.model_name, "max_context_length": s.max_context_length,
                                  "trainable": s.trainable, "sampleable": s.sampleable}
                                 for s in resp.supported_models],
            "cycle_s": resp.cycle_s}  # Bios's own field: the tinker SDK ignores fields it does not know


def checkpoint_path(run_id: str, checkpoint_id: str) -> str:
    """The path of checkpoint `<kind>/<name>` of a run, checked."""
    kind, _, name = checkpoint_id.partition("/")
    return str(CheckpointPath.parse(f"tinker://{run_id}/{kind}/{name}", field="checkpoint_id"))
