"""Hugging Face checkpoints in and out: a model directory (``config.json`` and
``model.safetensors`` or ``model.safetensors.index.json`` + shards) <-> a
:class:`~jax_wgrad.GPTConfig` and canonical parameters (:func:`~jax_wgrad.init_params`'s
tree, numpy).

The one table is :func:`hf_tensors`: every HF tensor's name, shape and the canonical
region (a numpy view) it is. Import writes each tensor into its view, export reads the
views; so the two directions cannot disagree. Layouts:

* ``q_proj``/``k_proj``/``v_proj`` ``[heads * d, H]`` -> ``qkv [ng * (hpg + 2) * d, H]``,
  group-major (per query group: its ``hpg`` query heads, its key head, its value head --
  Megatron's GQA layout; HF's ``repeat_kv`` gives query head ``h`` key/value head
  ``h // hpg``, the same grouping). RoPE is HF's ``rotate_half`` convention here too, so no
  permutation of rows.
* ``gate_proj``/``up_proj`` -> ``fc1 [2, F, H]``, ``down_proj`` -> ``fc2``;
  Mixtral's ``w1``/``w3`` -> ``experts.fc1 [E, 2, F, H]`` ``[:, 0]``/``[:, 1]``, ``w2`` ->
  ``experts.fc2``, ``block_sparse_moe.gate`` -> ``router``; Qwen3-MoE's
  ``mlp.experts.{e}.gate_proj``/``up_proj``/``down_proj`` and ``mlp.gate`` likewise
  (transformers 5's in-memory names ``mlp.gate``/``mlp.experts.gate_up_proj`` ``[E, 2F,
  H]``/``down_proj`` are read too).
* Qwen3's ``self_attn.q_norm``/``k_norm`` ``[d]`` -> ``q_norm.scale``/``k_norm.scale``.

Import is streamed: one shard open at a time (``safe_open`` maps it), each tensor copied
into the preallocated fp32 canonical arrays and dropped; so the memory beyond the result
is at most one shard's mapped pages.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import ml_dtypes
import numpy as np

from jax_wgrad.interop.hf_config import (
    config_from_hf,
    expert_family,
    head_dim,
    hf_config_from,
    hf_defaults_note,
)
from jax_wgrad.models.gpt.config import GPTConfig
from jax_wgrad.models.gpt.params import init_params

__all__ = [
    "HFTensor",
    "canonical_arrays",
    "export_hf",
    "hf_tensors",
    "import_hf",
    "check_shards",
    "checked_hf_config",
    "read_hf_config",
    "read_hf_tensors",
    "read_json",
    "shard_files",
]

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
"""Buffers some older checkpoints hold; recomputed, never read."""


@dataclasses.dataclass(frozen=True)
class HFTensor:
    """One Hugging Face tensor: its ``name``, HF ``shape``, the canonical ``leaf``
    (dotted path) it lives in and ``view(params)``: that region of the leaf (a numpy view,
    written in place on import)."""

    name: str
    shape: tuple[int, ...]
    leaf: str
    view: Callable[[dict], np.ndarray]


def _get(tree: dict, leaf: str):
    for k in leaf.split("."):
        tree = tree[k]
    return tree


def _region(leaf: str, *index) -> Callable[[dict], np.ndarray]:
    def view(params):
        return _get(params, leaf)[index] if index else _get(params, leaf)

    return view


def _qkv_region(leaf: str, j: int, part: str, ng: int, hpg: int, d: int):
    """Query (``part="q"``), key or value rows of layer ``j``'s group-major qkv leaf, as
    ``[ng, heads per group, d, ...]``."""
    sl = {"q": slice(0, hpg), "k": slice(hpg, hpg + 1), "v": slice(hpg + 1, hpg + 2)}[part]

    def view(params):
        a = _get(params, leaf)[j]
        return a.reshape(ng, hpg + 2, d, *a.shape[1:])[:, sl]

    return view


def _attention(cfg: GPTConfig, p: str, key: str, j: int) -> list[HFTensor]:
    nh, h, d = cfg.num_attention_heads, cfg.hidden_size, head_dim(cfg)
    ng = cfg.num_query_groups or nh
    out = []
    for part, heads in (("q", nh), ("k", ng), ("v", ng)):
        for kind, shape in (("weight", (heads * d, h)), ("bias", (heads * d,))):
            if kind == "bias" and not (cfg.add_bias_linear or cfg.add_qkv_bias):
                continue
            leaf = f"{key}.qkv.{kind}"
            out.append(
                HFTensor(
                    f"{p}self_attn.{part}_proj.{kind}",
                    shape,
                    leaf,
                    _qkv_region(leaf, j, part, ng, nh // ng, d),
                )
            )
    out.append(
        HFTensor(
            f"{p}self_attn.o_proj.weight",
            (h, nh * d),
            f"{key}.proj.weight",
            _region(f"{key}.proj.weight", j),
        )
    )
    if cfg.add_bias_linear:
        out.append(
            HFTensor(
                f"{p}self_attn.o_proj.bias",
                (h,),
                f"{key}.proj.bias",
                _region(f"{key}.proj.bias", j),
            )
        )
    if getattr(cfg, "qk_layernorm", False):  # Qwen3: RMSNorm over each head, before RoPE
        for part in ("q", "k"):
            leaf = f"{key}.{part}_norm.scale"
            out.append(HFTensor(f"{p}self_attn.{part}_norm.weight", (d,), leaf, _region(leaf, j)))
    return out


def _mlp(cfg: GPTConfig, p: str, key: str, j: int) -> list[HFTensor]:
    h, f = cfg.hidden_size, cfg.ffn_hidden_size
    out = []
    for kind in ("weight", "bias"):
        if kind == "bias" and not cfg.add_bias_linear:
            continue
        mat = (lambda *s: s) if kind == "weight" else (lambda *s: s[:1])
        fc1, fc2 = f"{key}.fc1.{kind}", f"{key}.fc2.{kind}"
        out += [
            HFTensor(f"{p}mlp.gate_proj.{kind}", mat(f, h), fc1, _region(fc1, j, 0)),
            HFTensor(f"{p}mlp.up_proj.{kind}", mat(f, h), fc1, _region(fc1, j, 1)),
            HFTensor(f"{p}mlp.down_proj.{kind}", mat(h, f), fc2, _region(fc2, j)),
        ]
    return out


_EXPERT_NAMES = {
    "mixtral": ("block_sparse_moe.", "w1", "w3", "w2"),
    "qwen3_moe": ("mlp.", "gate_proj", "up_proj", "down_proj"),
}
"""Per family: the MoE block's prefix and the names of an expert's gate, up and down
weights in checkpoint files."""


def _experts(cfg: GPTConfig, p: str, key: str, j: int) -> list[HFTensor]:
    h, f, e_num = cfg.hidden_size, cfg.moe_ffn_hidden_size, cfg.num_moe_experts
    block, gate, up, down = _EXPERT_NAMES[expert_family(cfg)]
    fc1, fc2, q = f"{key}.experts.fc1", f"{key}.experts.fc2", f"{p}{block}"
    out = [HFTensor(f"{q}gate.weight", (e_num, h), f"{key}.router", _region(f"{key}.router", j))]
    for e in range(e_num):
        out += [
            HFTensor(f"{q}experts.{e}.{gate}.weight", (f, h), fc1, _region(fc1, j, e, 0)),
            HFTensor(f"{q}experts.{e}.{up}.weight", (f, h), fc1, _region(fc1, j, e, 1)),
            HFTensor(f"{q}experts.{e}.{down}.weight", (h, f), fc2, _region(fc2, j, e)),
        ]
    return out


def _experts_v5(cfg: GPTConfig, p: str, key: str, j: int) -> list[HFTensor]:
    """transformers 5's fused in-memory names (read only; files use :func:`_experts`'):
    the same for Mixtral and Qwen3-MoE (whose router name is the files' one)."""
    h, f, e_num = cfg.hidden_size, cfg.moe_ffn_hidden_size, cfg.num_moe_experts
    fc1, fc2 = f"{key}.experts.fc1", f"{key}.experts.fc2"
    out = [
        HFTensor(f"{p}mlp.experts.gate_up_proj", (e_num, 2 * f, h), fc1, _region(fc1, j)),
        HFTensor(f"{p}mlp.experts.down_proj", (e_num, h, f), fc2, _region(fc2, j)),
    ]
    if expert_family(cfg) == "mixtral":  # its files name the router block_sparse_moe.gate
        router = f"{key}.router"
        out.append(HFTensor(f"{p}mlp.gate.weight", (e_num, h), router, _region(router, j)))
    return out


def hf_tensors(cfg: GPTConfig, *, aliases: bool = False) -> list[HFTensor]:
    """Every tensor of ``cfg``'s Hugging Face checkpoint, in the order written (with
    ``aliases``: also the other spellings an import accepts)."""
    h, v = cfg.hidden_size, cfg.vocab_size
    out = [
        HFTensor(
            "model.embed_tokens.weight",
            (v, h),
            "embedding.word.embedding",
            _region("embedding.word.embedding", slice(0, v)),  # the padding: not in HF
        )
    ]
    seen = {"layers": 0, "moe_layers": 0}
    for i, moe in enumerate(cfg.moe_layer_pattern):
        key = "moe_layers" if moe else "layers"
        j, p = seen[key], f"model.layers.{i}."
        seen[key] += 1
        out += [
            HFTensor(
                f"{p}input_layernorm.weight",
                (h,),
                f"{key}.ln1.scale",
                _region(f"{key}.ln1.scale", j),
            )
        ]
        out += _attention(cfg, p, key, j)
        out += [
            HFTensor(
                f"{p}post_attention_layernorm.weight",
                (h,),
                f"{key}.ln2.scale",
                _region(f"{key}.ln2.scale", j),
            )
        ]
        out += (
            _experts(cfg, p, key, j) + (_experts_v5(cfg, p, key, j) if aliases else [])
            if moe
            else _mlp(cfg, p, key, j)
        )
    out.append(
        HFTensor(
            "model.norm.weight", (h,), "head.final_norm.scale", _region("head.final_norm.scale")
        )
    )
    if cfg.untie_embeddings_and_output_weights:
        out.append(
            HFTensor(
                "lm_head.weight",
                (v, h),
                "head.output.weight",
                _region("head.output.weight", slice(0, v)),
            )
        )
    return out


def canonical_arrays(cfg: GPTConfig) -> dict:
    """Uninitialised fp32 numpy arrays of :func:`init_params`'s tree (its shapes; fp32
    whatever ``cfg.params_dtype``: a run with bf16 parameters rounds them itself), pages
    untouched until written."""
    shapes = jax.eval_shape(functools.partial(init_params, cfg, 0))
    return jax.tree.map(lambda s: np.empty(s.shape, np.float32), shapes)


def _leaves(params: dict) -> dict[str, Any]:
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    return {".".join(k.key for k in path): a for path, a in flat}


def read_json(path: Path) -> dict:
    """The JSON object in ``path``.

    Raises:
      ValueError: the file is missing, unreadable or not a JSON object (the file named).
    """
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file") from None
    except OSError as exc:
        raise ValueError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a JSON {type(data).__name__}, not an object")
    return data


def read_hf_config(directory: str | os.PathLike) -> dict:
    """The ``config.json`` of an HF model directory (a dict); a missing or broken file is a
    ``ValueError`` naming it."""
    return read_json(Path(directory) / "config.json")


def shard_files(directory: str | os.PathLike) -> list[Path]:
    """The safetensors files of an HF directory, in index order.

    Raises:
      ValueError: no safetensors weights (e.g. only ``pytorch_model.bin``), an index that
        is broken or names a shard that is not there (the file named).
    """
    d = Path(directory)
    if (d / INDEX).is_file():
        weight_map = read_json(d / INDEX).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{d / INDEX}: has no 'weight_map' object")
        files = [d / f for f in dict.fromkeys(weight_map.values())]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ValueError(
                f"{d / INDEX}: names shard(s) that are not there: " + ", ".join(missing)
            )
        return files
    if (d / SINGLE).is_file():
        return [d / SINGLE]
    others = sorted(p.name for p in d.glob("*.bin")) + sorted(p.name for p in d.glob("*.pt"))
    raise ValueError(
        f"{d}: neither {SINGLE} nor {INDEX}"
        + (
            f" (found {', '.join(others)}: only safetensors weights are read; convert them "
            "with transformers' save_pretrained(..., safe_serialization=True))"
            if others
            else ""
        )
    )


def check_shards(directory: str | os.PathLike, cfg: GPTConfig | None = None) -> list[Path]:
    """:func:`shard_files`, each file's header read (cheap: no tensor is loaded), so that a
    missing, truncated or foreign shard is refused before anything is built; with ``cfg``
    also every tensor's name and shape against :func:`hf_tensors` (e.g. a config whose
    left-out sizes got transformers' defaults, which the weights do not have).

    Raises:
      ValueError: naming the directory or the file and what is wrong.
    """
    from safetensors import SafetensorError, safe_open

    files = shard_files(directory)
    table = None if cfg is None else {t.name: t for t in hf_tensors(cfg, aliases=True)}
    for path in files:
        try:
            with safe_open(path, framework="numpy") as f:
                for name in f.keys():
                    if table is not None:
                        _table_entry(path, name, tuple(f.get_slice(name).get_shape()), table, cfg)
        except (SafetensorError, OSError) as exc:
            raise ValueError(f"{path}: not a readable safetensors file ({exc})") from None
    return files


def _table_entry(path: Path, name: str, shape: tuple, table: dict, cfg) -> HFTensor | None:
    """The table's entry of a file's tensor ``name`` of ``shape``; ``None``: one that is
    skipped (recomputed buffers, a tied model's ``lm_head``).

    Raises:
      ValueError: the tensor has no place in the model, or another shape (named).
    """
    tied = not cfg.untie_embeddings_and_output_weights
    if name.endswith(_IGNORED_SUFFIXES) or (tied and name == "lm_head.weight"):
        return None
    entry = table.get(name)
    if entry is None:
        raise ValueError(
            f"{path}: tensor {name!r} has no place in this model "
            "(a different architecture or an option not mapped)"
        )
    if tuple(shape) != entry.shape:
        raise ValueError(
            f"{path}: tensor {name!r} has shape {tuple(shape)}, the config makes it {entry.shape}"
        )
    return entry


def import_hf(directory: str | os.PathLike, **overrides) -> tuple[GPTConfig, dict]:
    """``(config, canonical params as fp32 numpy)`` of an HF model directory, streamed
    shard by shard. ``overrides``: GPTConfig fields (:func:`config_from_hf`).

    Raises:
      ValueError: a config the GPT cannot represent; a tensor of the wrong shape, one
        with no place in the model, or missing ones (named).
    """
    cfg = checked_hf_config(directory, **overrides)
    return cfg, read_hf_tensors(directory, cfg, canonical_arrays(cfg))


def checked_hf_config(directory: str | os.PathLike, **overrides) -> GPTConfig:
    """The :class:`GPTConfig` of an HF directory's ``config.json``
    (:func:`~jax_wgrad.interop.config_from_hf`), every shard's header checked against it
    (:func:`check_shards`: names and shapes, no tensor loaded, nothing allocated).

    Raises:
      ValueError: as :func:`~jax_wgrad.interop.config_from_hf` and :func:`check_shards`; a
        shape that differs ends naming the keys config.json left out and their defaults.
    """
    hf = read_hf_config(directory)
    cfg = config_from_hf(hf, **overrides)
    try:
        check_shards(directory, cfg)
    except ValueError as exc:  # e.g. a size config.json left out: transformers' default
        raise ValueError(f"{exc}{hf_defaults_note(hf)}") from None
    return cfg


def read_hf_tensors(directory: str | os.PathLike, cfg: GPTConfig, params: dict) -> dict:
    """Fills the canonical numpy arrays ``params`` (e.g. :func:`canonical_arrays`) from an
    HF directory's safetensors, one shard open at a time; returns ``params``.

    Raises:
      ValueError: a tensor of the wrong shape or with no place in the model; parameters
        the files do not (fully) give (named, with missing tensor names).
    """
    table = {t.name: t for t in hf_tensors(cfg, aliases=True)}
    written = dict.fromkeys(_leaves(params), 0)
    for leaf in ("embedding.word.embedding", "head.output.weight"):  # Megatron's padding
        if leaf in written:  # rows: zero (the directory has none; never in the loss)
            padding = _get(params, leaf)[cfg.vocab_size :]
            padding[...] = 0
            written[leaf] += padding.size
    for path in shard_files(directory):
        _read_shard(path, table, params, written, cfg)
    sizes = {k: a.size for k, a in _leaves(params).items()}
    short = [k for k in sizes if written[k] != sizes[k]]
    if short:
        missing = [t.name for t in hf_tensors(cfg) if t.leaf in short][:8]
        raise ValueError(
            f"{directory}: parameters {short} are not (fully) given by the "
            f"checkpoint; missing tensors include {missing}"
        )
    return params


def _read_shard(path: Path, table: dict, params: dict, written: dict, cfg) -> None:
    from safetensors import SafetensorError

    try:
        _read_shard_tensors(path, table, params, written, cfg)
    except (SafetensorError, OSError) as exc:  # truncated, not safetensors, unreadable
        raise ValueError(f"{path}: not a readable safetensors file ({exc})") from None


def _read_shard_tensors(path: Path, table: dict, params: dict, written: dict, cfg) -> None:
    from safetensors import safe_open

    with safe_open(path, framework="numpy") as f:
        for name in f.keys():
            entry = _table_entry(path, name, f.get_slice(name).get_shape(), table, cfg)
            if entry is None:
                continue
            tensor = f.get_tensor(name)
            view = entry.view(params)
            view[...] = tensor.reshape(view.shape)
            written[entry.leaf] += tensor.size
            del tensor


_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


def export_hf(
    cfg: GPTConfig,
    params: dict,
    directory: str | os.PathLike,
    *,
    max_shard_bytes: int = 5 * 2**30,
    dtype: str = "float32",
    family: str | None = None,
    extra_config: dict | None = None,
) -> list[Path]:
    """Writes ``cfg`` and canonical ``params`` (numpy or jax arrays) as an HF model
    directory ``transformers`` loads: ``config.json`` (:func:`hf_config_from`, updated by
    ``extra_config``, e.g. token ids), safetensors shards of at most ``max_shard_bytes``
    (one tensor bigger than that gets a shard of its own) with their index, or one
    ``model.safetensors``; ``generation_config.json`` only when ``extra_config`` gives
    token ids. Returns the files written.

    Raises:
      ValueError: ``max_shard_bytes`` below 1, or ``directory`` is a file.
    """
    from safetensors.numpy import save_file

    if max_shard_bytes < 1:
        raise ValueError(f"export_hf: max_shard_bytes must be positive, got {max_shard_bytes!r}")
    if Path(directory).exists() and not Path(directory).is_dir():
        raise ValueError(f"export_hf: {directory} is a file, not a directory")
    hf = {**hf_config_from(cfg, family=family, dtype=dtype), **(extra_config or {})}
    np_dtype = _DTYPES[dtype]
    params = jax.tree.map(np.asarray, params)
    tensors = hf_tensors(cfg)
    shards, size = [[]], 0
    for t in tensors:
        n = int(np.prod(t.shape)) * np.dtype(np_dtype).itemsize
        if shards[-1] and size + n > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += n
    out_dir = Path(directory)
    out_dir.mkdir(parents=True, exist_ok=True)
    names = (
        [SINGLE]
        if len(shards) == 1
        else [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    )
    files = []
    for name, shard in zip(names, shards):
        data = {
            t.name: np.ascontiguousarray(t.view(params)).reshape(t.shape).astype(np_dtype)
            for t in shard
        }
        save_file(data, str(out_dir / name), metadata={"format": "pt"})
        os.chmod(out_dir / name, 0o644)  # safetensors creates its files private
        files.append(out_dir / name)
        del data
    if len(shards) > 1:
        total = sum(int(np.prod(t.shape)) * np.dtype(np_dtype).itemsize for t in tensors)
        index = {
            "metadata": {"total_size": total},
            "weight_map": {t.name: n for n, s in zip(names, shards) for t in s},
        }
        files.append(_write_json(out_dir / INDEX, index))
    files.append(_write_json(out_dir / "config.json", hf))
    tokens = {
        k: hf[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if hf.get(k) is not None
    }
    if tokens:
        files.append(_write_json(out_dir / "generation_config.json", tokens))
    return files


def _write_json(path: Path, obj) -> Path:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
    return path
