"""Hugging Face safetensors checkpoints <-> our parameters: `HFCheckpoint` reads one lazily, `save_hf` writes one.

Reads and writes the layout `transformers` uses for Llama, Mistral, Mixtral and GPT-OSS (and that published
checkpoints use): our module names equal HF's, except that our Mixtral experts are stacked
(`...block_sparse_moe.experts.w1` [E, inter, dim]) where HF stores one tensor per expert
(`...block_sparse_moe.experts.{j}.w1.weight`). GPT-OSS's published expert weights are MXFP4
(`...mlp.experts.gate_up_proj_blocks` / `_scales`, `phalanx.models.mxfp4`): read dequantized to the dtype asked
for; `save_hf` writes them unquantized (the layout transformers saves a dequantized GPT-OSS in).
`HFCheckpoint.read_rows` reads rows [a, b) of one of *our* parameters without reading the rest of the tensor,
so a sharded loader can give each rank only its shard.
The `config.json` mapping is `phalanx.models.hf_config` (its names are importable from here too).
Knows nothing about torch.distributed (DTensors are recognised by duck typing), training or the CLI;
needs only `safetensors`, never `transformers`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from phalanx.models.config import ModelConfig
from phalanx.models.hf_config import (  # noqa: F401 - the config mapping, importable from here as before
    SUPPORTED_MODEL_TYPES,
    HFFormatError,
    config_from_hf,
    config_to_hf,
    read_hf_config,
    read_hf_config_json,
)
from phalanx.models.llama import Transformer
from phalanx.models.mxfp4 import BLOCK_VALUES, dequantize_mxfp4

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_EXPERT_PARAM = re.compile(r"^model\.layers\.(\d+)\.block_sparse_moe\.experts\.(w[123])$")
_ROUTER_PARAM = re.compile(r"^model\.layers\.(\d+)\.block_sparse_moe\.gate\.weight$")


# ---- parameter names ------------------------------------------------------------------------------------


def expected_shapes(cfg: ModelConfig) -> dict[str, torch.Size]:
    """Our parameter names and full shapes for `cfg` (a tied lm_head is not listed: it is the embedding)."""
    with torch.device("meta"):
        model = Transformer(cfg)
    return {name: p.shape for name, p in model.named_parameters()}


def _is_ignored(hf_key: str) -> bool:
    return hf_key.endswith("rotary_emb.inv_freq")


def _expert_key(layer: str, w: str, expert: int) -> str:
    return f"model.layers.{layer}.block_sparse_moe.experts.{expert}.{w}.weight"


@dataclass(frozen=True)
class _Source:
    """Where one of our parameters lives in the checkpoint."""

    # "plain": keys[0] as is; "experts": one key per expert; "fused": keys[0][:, cols[0]:cols[1]];
    # "mxfp4": keys = (blocks, scales), dequantized and transposed to our [E, in, out]
    kind: str
    keys: tuple[str, ...]
    cols: tuple[int, int] | None = None


# ---- reading --------------------------------------------------------------------------------------------


class HFCheckpoint:
    """A local HF model directory, read lazily. Opening it checks names and shapes against config.json.

    Every parameter of the model the config describes must be present with the right shape, and every
    tensor in the files must belong to one (`rotary_emb.inv_freq` excepted); with tied embeddings a stored
    `lm_head.weight` is ignored (transformers ties it to `model.embed_tokens.weight`, as we do).
    Also reads transformers 5's fused expert layout (`mlp.experts.gate_up_proj` / `down_proj`).
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.hf_config = read_hf_config_json(self.path)
        self.config = config_from_hf(self.hf_config)
        self._handles: dict[str, object] = {}
        self._key_file = self._find_tensor_files()
        self._shapes = expected_shapes(self.config)
        self._sources = self._map_sources()

    def _find_tensor_files(self) -> dict[str, str]:
        index = self.path / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text()).get("weight_map")
            except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as err:
                raise HFFormatError(f"{index} is not a valid checkpoint index ({err})") from None
            if not isinstance(weight_map, dict) or not weight_map:
                raise HFFormatError(f"{index} has no 'weight_map'; the sharded checkpoint index is corrupt")
            for file in sorted(set(weight_map.values())):
                if not (self.path / file).is_file():
                    raise HFFormatError(f"{index} names shard {file!r}, which is missing from {self.path}")
            return dict(weight_map)
        if (self.path / SINGLE_FILE).is_file():
            return {key: SINGLE_FILE for key in self._open(SINGLE_FILE).keys()}
        raise HFFormatError(
            f"{str(self.path)!r} has no {SINGLE_FILE} or {INDEX_FILE}. Only safetensors checkpoints are supported; "
            "PyTorch .bin checkpoints are not: convert them to safetensors first (e.g. load with transformers "
            "and save_pretrained(..., safe_serialization=True))"
        )

    def _open(self, file: str):
        if file not in self._handles:
            try:
                self._handles[file] = safe_open(str(self.path / file), framework="pt")
            except Exception as err:  # noqa: BLE001 - safetensors raises its own error types (header, I/O)
                raise HFFormatError(f"{self.path / file} is not a readable safetensors file ({err})") from None
        return self._handles[file]

    def _slice(self, hf_key: str):
        return self._open(self._key_file[hf_key]).get_slice(hf_key)

    def _stored_shape(self, hf_key: str) -> tuple[int, ...]:
        return tuple(self._slice(hf_key).get_shape())

    def _shape_error(self, hf_key: str, got, want) -> HFFormatError:
        return HFFormatError(
            f"checkpoint tensor {hf_key!r} has shape {list(got)} but the model described by config.json needs "
            f"{list(want)}; config.json and the weights in {self.path} disagree"
        )

    def _map_sources(self) -> dict[str, _Source]:
        present = set(self._key_file)
        sources: dict[str, _Source] = {}
        missing = []
        for name, shape in self._shapes.items():
            source = self._source_for(name, shape, present)
            if source is None:
                missing.append(name)
            else:
                sources[name] = source
        if missing:
            raise HFFormatError(
                f"checkpoint {self.path} lacks {len(missing)} tensor(s) the model described by config.json needs, "
                f"e.g. {missing[:5]}"
            )
        used = {key for source in sources.values() for key in source.keys}
        if self.config.tie_embeddings:
            sources["lm_head.weight"] = sources["model.embed_tokens.weight"]
            used.add("lm_head.weight")
        unused = sorted(k for k in present - used if not _is_ignored(k))
        if unused:
            raise HFFormatError(
                f"checkpoint {self.path} holds {len(unused)} tensor(s) no Phalanx parameter takes, e.g. {unused[:5]}; "
                "is config.json for these weights?"
            )
        return sources

    def _source_for(self, name: str, shape: torch.Size, present: set[str]) -> _Source | None:
        """Locate `name` in the checkpoint (None if absent) and check the stored shape."""
        expert = _EXPERT_PARAM.match(name)
        router = _ROUTER_PARAM.match(name)
        if expert:
            layer, w = expert.groups()
            keys = tuple(_expert_key(layer, w, e) for e in range(shape[0]))
            if all(k in present for k in keys):
                for k in keys:
                    if self._stored_shape(k) != tuple(shape[1:]):
                        raise self._shape_error(k, self._stored_shape(k), shape[1:])
                return _Source("experts", keys)
            fused = f"model.layers.{layer}.mlp.experts.{'down_proj' if w == 'w2' else 'gate_up_proj'}"
            if fused not in present:
                return None
            inter = self.config.intermediate_size
            cols = None if w == "w2" else (0, inter) if w == "w1" else (inter, 2 * inter)
            want = tuple(shape) if w == "w2" else (shape[0], 2 * inter, shape[2])
            if self._stored_shape(fused) != want:
                raise self._shape_error(fused, self._stored_shape(fused), want)
            return _Source("fused", (fused,), cols)
        if name not in present and f"{name}_blocks" in present and f"{name}_scales" in present:
            return self._mxfp4_source(name, shape)
        key = name
        if router and name not in present:
            key = f"model.layers.{router.group(1)}.mlp.gate.weight"
        if key not in present:
            return None
        if self._stored_shape(key) != tuple(shape):
            raise self._shape_error(key, self._stored_shape(key), shape)
        return _Source("plain", (key,))

    def _mxfp4_source(self, name: str, shape: torch.Size) -> _Source:
        """Our [E, in, out] expert weight stored as MXFP4 blocks [E, out, in / 32, 16] and scales [E, out, in / 32]."""
        blocks, scales = f"{name}_blocks", f"{name}_scales"
        if len(shape) != 3 or shape[1] % BLOCK_VALUES:
            raise HFFormatError(
                f"checkpoint tensor {blocks!r} is MXFP4, which Phalanx reads only for stacked expert weights with an "
                f"input width divisible by {BLOCK_VALUES}; {name!r} has shape {list(shape)}"
            )
        groups = shape[1] // BLOCK_VALUES
        want = {blocks: (shape[0], shape[2], groups, BLOCK_VALUES // 2), scales: (shape[0], shape[2], groups)}
        for key, want_shape in want.items():
            if self._stored_shape(key) != want_shape:
                raise self._shape_error(key, self._stored_shape(key), want_shape)
        return _Source("mxfp4", (blocks, scales))

    def names(self) -> list[str]:
        """Our parameter names, in model order (a tied `lm_head.weight` is readable but not listed)."""
        return list(self._shapes)

    def shape(self, name: str) -> torch.Size:
        """Full shape of our parameter `name` (experts stacked)."""
        tied_head = name == "lm_head.weight" and self.config.tie_embeddings
        return self._shapes["model.embed_tokens.weight" if tied_head else self._known(name)]

    def _known(self, name: str) -> str:
        if name not in self._sources:
            raise KeyError(f"{name!r} is not a parameter of this checkpoint's model; see HFCheckpoint.names()")
        return name

    def read_rows(self, name: str, row_start: int, row_end: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows [row_start, row_end) along dim 0 of our parameter `name`, reading only those rows from disk.

        For stacked expert weights a row is one expert. Returns a new CPU tensor in `dtype`.
        """
        source = self._sources[self._known(name)]
        shape = self.shape(name)
        if not 0 <= row_start <= row_end <= shape[0]:
            raise ValueError(f"rows [{row_start}, {row_end}) are out of range for {name!r} with {shape[0]} rows")
        if source.kind == "plain":
            rows = self._slice(source.keys[0])[row_start:row_end]
        elif source.kind == "mxfp4":  # one expert at a time: the LUT indices are 8 bytes per value
            blocks, scales = (self._slice(k) for k in source.keys)
            parts = [dequantize_mxfp4(blocks[e : e + 1], scales[e : e + 1], dtype) for e in range(row_start, row_end)]
            rows = torch.cat(parts).transpose(1, 2) if parts else torch.empty((0, *shape[1:]))
        elif source.kind == "experts":
            parts = [self._slice(k)[:] for k in source.keys[row_start:row_end]]
            rows = torch.stack(parts) if parts else torch.empty((0, *shape[1:]))
        else:
            cols = slice(*source.cols) if source.cols else slice(None)
            rows = self._slice(source.keys[0])[row_start:row_end, cols]
        return rows.to(dtype).contiguous()

    def read(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.read_rows(name, 0, self.shape(name)[0], dtype)

    def close(self) -> None:
        self._handles.clear()

    def __enter__(self) -> "HFCheckpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def load_hf_model(path: str | os.PathLike, dtype: torch.dtype = torch.float32, device="cpu") -> Transformer:
    """A `Transformer` with every parameter loaded from the HF checkpoint directory `path`."""
    with HFCheckpoint(path) as ckpt:
        with torch.device("meta"):
            model = Transformer(ckpt.config)
        model = model.to(dtype=dtype).to_empty(device=device)
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(ckpt.read(name, dtype))
    model.reset_buffers()
    return model


# ---- writing --------------------------------------------------------------------------------------------


def _hf_entries(name: str, shape: torch.Size) -> list[tuple[str, int | None]]:
    """(HF key, expert index or None) for each tensor our parameter `name` is written as."""
    expert = _EXPERT_PARAM.match(name)
    if expert is None:
        return [(name, None)]
    layer, w = expert.groups()
    return [(_expert_key(layer, w, e), e) for e in range(shape[0])]


def _full(value) -> torch.Tensor:
    """A plain CPU tensor: DTensors (anything with `full_tensor`) are gathered first - a collective."""
    if hasattr(value, "full_tensor"):
        value = value.full_tensor()
    return value.detach().cpu()


def save_hf(
    model_or_state_dict: nn.Module | dict,
    config: ModelConfig,
    path: str | os.PathLike,
    *,
    max_shard_size_bytes: int = 5 * 2**30,
    dtype: torch.dtype | None = None,
    overwrite: bool = False,
    write: bool = True,
) -> None:
    """Write an HF checkpoint directory (config.json + safetensors) that `transformers` loads as is.

    Files go to a temporary sibling directory that is renamed into place at the end, so a crash never
    leaves a partial checkpoint at `path`. Above `max_shard_size_bytes` the weights are split into
    `model-0000i-of-0000N.safetensors` plus `model.safetensors.index.json`. `dtype`: cast on write.
    `overwrite`: replace an existing checkpoint (a directory holding config.json) at `path`.
    With DTensor values every rank must call this (gathering is collective); ranks other than the
    writer pass `write=False`. Memory: one shard file's tensors plus one gathered parameter.
    """
    state = model_or_state_dict.state_dict() if isinstance(model_or_state_dict, nn.Module) else model_or_state_dict
    state = {k: v for k, v in state.items() if not _is_ignored(k)}
    if config.tie_embeddings:
        state.pop("lm_head.weight", None)
    shapes = expected_shapes(config)
    unknown, missing = sorted(set(state) - set(shapes)), sorted(set(shapes) - set(state))
    if unknown or missing:
        raise HFFormatError(
            f"state dict does not match the model config: unexpected keys {unknown[:5]}, missing keys {missing[:5]}"
        )
    for name, shape in shapes.items():
        if tuple(state[name].shape) != tuple(shape):
            raise HFFormatError(f"state dict {name!r} has shape {list(state[name].shape)}, config needs {list(shape)}")

    out_dtype = {name: dtype or state[name].dtype for name in shapes}
    entries = []  # (hf key, our name, expert index, bytes), in parameter order
    for name, shape in shapes.items():
        per_tensor = shape[1:] if _EXPERT_PARAM.match(name) else shape
        nbytes = per_tensor.numel() * out_dtype[name].itemsize
        entries += [(key, name, e, nbytes) for key, e in _hf_entries(name, shape)]
    shards: list[list[tuple]] = [[]]
    shard_bytes = 0
    for entry in entries:
        if shards[-1] and shard_bytes + entry[3] > max_shard_size_bytes:
            shards.append([])
            shard_bytes = 0
        shards[-1].append(entry)
        shard_bytes += entry[3]

    path = Path(path)
    if write and path.exists() and (not path.is_dir() or any(path.iterdir())):
        if not overwrite or not (path / "config.json").is_file():
            raise HFFormatError(
                f"save_hf path {str(path)!r} already exists and is not empty; choose a new path, or pass "
                "overwrite=True to replace an existing HF checkpoint there"
            )
    tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:8]}"
    if write:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
    try:
        weight_map: dict[str, str] = {}
        cached_name, cached = None, None
        for i, shard in enumerate(shards):
            file = SINGLE_FILE if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            tensors = {}
            for key, name, expert, _ in shard:
                if name != cached_name:
                    cached_name, cached = name, _full(state[name]).to(out_dtype[name])
                # Experts are cloned out of the stack: safetensors refuses tensors that share storage.
                tensors[key] = cached.contiguous() if expert is None else cached[expert].clone()
                weight_map[key] = file
            if write:
                save_file(tensors, str(tmp / file), metadata={"format": "pt"})
        if not write:
            return
        if len(shards) > 1:
            index = {"metadata": {"total_size": sum(e[3] for e in entries)}, "weight_map": weight_map}
            (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        first_dtype = out_dtype[next(iter(shapes))]
        (tmp / "config.json").write_text(json.dumps(config_to_hf(config, dtype=first_dtype), indent=2) + "\n")
        for file in tmp.iterdir():  # data on disk before the rename makes it visible
            with open(file, "rb") as f:
                os.fsync(f.fileno())
        if path.exists():
            old = path.parent / f".{path.name}.old-{uuid.uuid4().hex[:8]}"
            path.rename(old)
            tmp.rename(path)
            shutil.rmtree(old)
        else:
            tmp.rename(path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
