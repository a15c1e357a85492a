"""Model surgery for training: replace attention modules or decoder layers of a loaded Hugging Face causal LM,
keep the new parameters under a method's own names, and reload a trained model with its surgery.

The methods that change the model itself (RePo's learned positions, L2A's routed global attention, and later
Softplus attention and C-DIC's adapters) all need the same four things, built once here:

* **Anatomy** (:func:`anatomy`): what differs between the supported architectures, read from the loaded model:
  where the layer norms sit (Llama / Qwen2 normalise the block input, *pre-norm*; OLMo-2 normalises the
  attention and MLP outputs, *post-norm*) and how q and k are normalised (OLMo-2's RMSNorm over the whole q / k
  projection before the head split; a per-head norm after it, as Qwen3 has). :func:`project_qkv` applies one
  attention module's projections and norms; :func:`rope_tables` / :func:`rotate` give RoPE with arbitrary real
  positions per head in fp32 (the model's own inverse frequencies and attention scaling, so integer positions
  reproduce the stock rotary embedding bit for bit). Unsupported architectures are refused in one line.
* **Replacement** (:func:`replace_attention`, :func:`replace_decoder_layer`): swap ``layers[l].self_attn`` or
  ``layers[l]`` for a module built from the old one. The replacement keeps the old submodules under their old
  names (``self_attn.q_proj`` ...), so the base weights keep their Hugging Face names and only the method's
  parameters are new.
* **Persistence**: a method writes its settings into ``model.config`` under its own key (RePo: ``pe_config``, the
  key of the released checkpoints; L2A: ``l2a_config``), so ``save_pretrained`` carries them and the settings
  hold for the model's whole life. :data:`SURGERIES` maps each key to the function that re-applies the surgery
  (``"module:function"`` strings: this substrate never imports a method package at import time);
  :func:`restore_surgery` re-applies it after ``from_pretrained`` and loads the method's tensors from the
  folder's safetensors files, strictly (a missing tensor is an error naming it). Softplus attention
  (``attention_score``) is a parameter-free setting registered the same way. ``load_causal_lm`` calls it for
  every local folder, so a trained folder reloads with the same logits through the one loader.
* **DDP safety** (:func:`keep_in_graph`): a branch that computes nothing in a step (L2A's global path when no
  token routes) still contributes ``0 * sum(params)``, so DistributedDataParallel sees a gradient (zero) for every
  trainable parameter and needs no ``find_unused_parameters``.
"""

from __future__ import annotations

import importlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch import nn

from litctx_common.errors import UnsupportedError

__all__ = [
    "Anatomy",
    "ARCHITECTURES",
    "SurgeryError",
    "anatomy",
    "decoder_layers",
    "project_qkv",
    "rope_tables",
    "rotate",
    "rotate_half",
    "replace_attention",
    "replace_decoder_layer",
    "SURGERIES",
    "surgery_of",
    "restore_surgery",
    "keep_in_graph",
    "checkpoint_tensors",
]

log = logging.getLogger("litctx.llm")


class SurgeryError(UnsupportedError):
    """A model, checkpoint or setting that a surgery cannot serve (the message says what is supported; the
    command line prints it as one line)."""


@dataclass(frozen=True)
class Anatomy:
    """What model surgery needs to know about an architecture.

    Attributes:
        model_type: the Hugging Face ``config.model_type``.
        norm: ``pre`` (the block input is normalised before attention: Llama, Qwen2) or ``post`` (the attention
            output is normalised before the residual add: OLMo-2).
        qk_norm: ``none``, ``projection`` (RMSNorm over the flat ``[Hq*d]`` / ``[Hk*d]`` projection, OLMo-2) or
            ``head`` (RMSNorm over each head's ``d``).
    """

    model_type: str
    norm: str
    qk_norm: str


ARCHITECTURES: Dict[str, Anatomy] = {
    "llama": Anatomy("llama", norm="pre", qk_norm="none"),
    "qwen2": Anatomy("qwen2", norm="pre", qk_norm="none"),
    "olmo2": Anatomy("olmo2", norm="post", qk_norm="projection"),
}


def _model_type(model_or_config: Any) -> str:
    config = getattr(model_or_config, "config", model_or_config)
    return str(getattr(config, "model_type", type(model_or_config).__name__))


def anatomy(model_or_config: Any, method: str = "model surgery") -> Anatomy:
    """The :class:`Anatomy` of a model (or its config); a one-line :class:`SurgeryError` for any other."""
    kind = _model_type(model_or_config)
    if kind not in ARCHITECTURES:
        raise SurgeryError(f"{method} supports the architectures {', '.join(sorted(ARCHITECTURES))} (Llama, Qwen2, "
                           f"OLMo-2); this model is model_type={kind!r}")
    return ARCHITECTURES[kind]


def decoder_layers(model: nn.Module) -> Tuple[str, nn.ModuleList]:
    """``(prefix, layers)``: the dotted path of a causal LM's decoder-layer list (``model.layers``) and the list.

    Raises:
        TypeError: ``model`` is not a Hugging Face decoder-only causal LM with ``<base_model_prefix>.layers``.
    """
    prefix = getattr(model, "base_model_prefix", "") or ""
    base = getattr(model, prefix, None) if prefix else None
    layers = getattr(base, "layers", None)
    if not isinstance(layers, nn.ModuleList) or not hasattr(model, "config"):
        raise TypeError(f"{type(model).__name__} is not a Hugging Face decoder-only causal LM with "
                        f"'<base_model_prefix>.layers' (Llama, Qwen2, OLMo-2, Gemma-3, ...)")
    return f"{prefix}.layers", layers


# ---------------------------------------------------------------------------------------------- attention anatomy
def project_qkv(attn: nn.Module, hidden: torch.Tensor, kind: Anatomy,
                prefix: str = "") -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Queries, keys and values of an attention module for ``hidden [B, N, D]``: ``q [B, Hq, N, d]``,
    ``k, v [B, Hk, N, d]`` (no RoPE yet). ``prefix`` selects another set of projections on the same module
    (``_global``: ``q_proj_global`` ...)."""
    d = attn.head_dim
    b, n, _ = hidden.shape
    q = getattr(attn, "q_proj" + prefix)(hidden)
    k = getattr(attn, "k_proj" + prefix)(hidden)
    v = getattr(attn, "v_proj" + prefix)(hidden)
    if kind.qk_norm == "projection":
        q, k = getattr(attn, "q_norm" + prefix)(q), getattr(attn, "k_norm" + prefix)(k)
    q, k, v = (t.view(b, n, -1, d).transpose(1, 2) for t in (q, k, v))
    if kind.qk_norm == "head":
        q, k = getattr(attn, "q_norm" + prefix)(q), getattr(attn, "k_norm" + prefix)(k)
    return q, k, v


def rope_tables(model: nn.Module) -> Tuple[torch.Tensor, float]:
    """``(inv_freq [d/2], attention_scaling)`` of the model's rotary embedding (``model.model.rotary_emb``)."""
    inner = getattr(model, "model", model)
    rotary = getattr(inner, "rotary_emb", None)
    if rotary is None or not hasattr(rotary, "inv_freq"):
        raise SurgeryError(f"{type(model).__name__} has no rotary embedding at .model.rotary_emb")
    return rotary.inv_freq, float(getattr(rotary, "attention_scaling", 1.0))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[x1, x2] -> [-x2, x1]`` over the last dimension (the Hugging Face half-split convention)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotate(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float = 1.0) -> torch.Tensor:
    """RoPE of ``x [B, H, N, d]`` at real ``positions [B, H, N]`` (one per head and token). The angles
    ``positions * inv_freq`` are computed in fp32 with autocast off (positions can be large reals; float64 for a
    float64 ``x``), cos / sin are cast to ``x``'s dtype as the stock rotary embedding does, so integer positions
    reproduce it exactly in fp32 / bf16 / fp16."""
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    with torch.autocast(device_type=x.device.type, enabled=False):
        freqs = positions[..., None].to(work) * inv_freq.to(device=x.device, dtype=work)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * scaling).to(x.dtype)
        sin = (emb.sin() * scaling).to(x.dtype)
    return x * cos + rotate_half(x) * sin


# ---------------------------------------------------------------------------------------------- replacement
def replace_attention(model: nn.Module, indices: Iterable[int],
                      build: Callable[[nn.Module, int], nn.Module]) -> None:
    """``layers[l].self_attn = build(old_self_attn, l)`` for every ``l`` in ``indices``."""
    layers = decoder_layers(model)[1]
    for i in indices:
        layers[i].self_attn = build(layers[i].self_attn, i)


def replace_decoder_layer(model: nn.Module, indices: Iterable[int],
                          build: Callable[[nn.Module, int], nn.Module]) -> None:
    """``layers[l] = build(old_layer, l)`` for every ``l`` in ``indices``."""
    layers = decoder_layers(model)[1]
    for i in indices:
        layers[i] = build(layers[i], i)


def keep_in_graph(out: torch.Tensor, params: Iterable[nn.Parameter]) -> torch.Tensor:
    """``out + 0 * sum(p)`` over the trainable ``params``: they get a (zero) gradient in a step where their branch
    computed nothing, so DDP's reducer sees every parameter (no unused-parameter error) without
    ``find_unused_parameters``. Outside autograd this returns ``out`` unchanged."""
    if not torch.is_grad_enabled():
        return out
    tie = None
    for p in params:
        if p.requires_grad:
            term = p.reshape(-1)[:1].sum() * 0.0
            tie = term if tie is None else tie + term
    return out if tie is None else out + tie.to(out.dtype)


# ---------------------------------------------------------------------------------------------- persistence
@dataclass(frozen=True)
class Surgery:
    """A registered surgery: the key its settings live under in a Hugging Face config, and the function
    (``"module:function"``, called as ``fn(model, settings: dict)``) that applies it from those settings."""

    name: str
    config_key: str
    apply: str
    description: str


SURGERIES: Dict[str, Surgery] = {
    "repo": Surgery("repo", "pe_config", "lightning_modules.repo.attention:apply_from_config",
                    "RePo: learned per-head positions fed into RoPE"),
    "l2a": Surgery("l2a", "l2a_config", "lightning_modules.l2a.layer:apply_from_config",
                   "L2A: sliding-window attention plus routed global attention"),
    "softplus": Surgery("softplus", "attention_score", "lightning_modules.softplus.attention:apply_from_config",
                        "Softplus attention: LSSA / LSSAR score mode in every layer (no new parameters)"),
    "block_diffusion": Surgery("block_diffusion", "block_diffusion",
                               "lightning_modules.bdlm.block_attention:apply_from_config",
                               "a block-diffusion LM: block-causal attention and a mask token (no new parameters)"),
}


def _config_dict(config: Any) -> Dict[str, Any]:
    if isinstance(config, dict):
        return config
    return {s.config_key: getattr(config, s.config_key, None) for s in SURGERIES.values()}


def surgery_of(config: Any) -> Optional[Surgery]:
    """The registered surgery whose settings a Hugging Face config (object or ``config.json`` dict) carries;
    None for a plain model. Settings of two surgeries at once are refused."""
    values = _config_dict(config)
    found = [s for s in SURGERIES.values() if values.get(s.config_key)]
    if len(found) > 1:
        raise SurgeryError(f"the config carries settings of several surgeries ({', '.join(s.name for s in found)}); "
                           f"one model holds one")
    if found and found[0].config_key == "pe_config" and values["pe_config"].get("dynamic_pe_mode") in (None, "none"):
        return None  # the released RoPE baselines carry a pe_config with mode "none": a plain model
    return found[0] if found else None


def _resolve(spec: str) -> Callable:
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def checkpoint_tensors(folder: Path, names: Sequence[str]) -> Dict[str, torch.Tensor]:
    """The tensors ``names`` from a Hugging Face folder's safetensors files (single file or sharded index)."""
    from safetensors import safe_open

    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
    else:
        single = folder / "model.safetensors"
        if not single.is_file():
            raise SurgeryError(f"{folder} has no model.safetensors (nor an index): save with save_pretrained")
        with safe_open(str(single), framework="pt") as f:
            weight_map = {k: "model.safetensors" for k in f.keys()}
    missing = [n for n in names if n not in weight_map]
    if missing:
        raise SurgeryError(f"{folder} lacks {len(missing)} tensor(s) of its surgery, e.g. {missing[:3]}: it was not "
                           f"saved from a model with this surgery")
    out: Dict[str, torch.Tensor] = {}
    by_file: Dict[str, List[str]] = {}
    for n in names:
        by_file.setdefault(weight_map[n], []).append(n)
    for file, keys in by_file.items():
        with safe_open(str(folder / file), framework="pt") as f:
            for k in keys:
                out[k] = f.get_tensor(k)
    return out


def restore_surgery(model: nn.Module, folder: Optional[Path] = None, expect: Optional[str] = None) -> Optional[str]:
    """Re-apply the surgery recorded in ``model.config`` (after ``from_pretrained``) and load its new tensors
    from ``folder``. Returns the surgery's name (None for a plain model).

    ``expect``: the surgery the caller needs; a model of another surgery (or a plain one) is a
    :class:`SurgeryError` saying what the folder holds."""
    found = surgery_of(model.config)
    if expect is not None and (found is None or found.name != expect):
        what = f"a {found.name} model ({found.config_key})" if found else "a plain model (no surgery settings)"
        wanted = SURGERIES[expect]
        raise SurgeryError(f"{folder or 'the model'} holds {what}, not a {expect} model: a {expect} checkpoint "
                           f"carries '{wanted.config_key}' in its config")
    if found is None:
        return None
    before = set(model.state_dict())
    settings = getattr(model.config, found.config_key)
    _resolve(found.apply)(model, dict(settings))
    new = [k for k in model.state_dict() if k not in before]
    if folder is not None and new:
        tensors = checkpoint_tensors(Path(folder), new)
        result = model.load_state_dict(tensors, strict=False)
        if result.unexpected_keys:
            raise SurgeryError(f"unexpected tensors {result.unexpected_keys[:3]} for surgery {found.name}")
    return found.name
