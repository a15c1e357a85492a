"""Draft models for speculative decoding, derived from the target model itself.

A speculative decoder proposes tokens with a small *draft* model and verifies them with the *target* in one
forward pass, so both must map text to the same token ids. Nothing smaller than SmolLM2-135M shares its
tokenizer offline, so the drafts here are cut from the target:

* :func:`early_exit_draft` - a *self-speculative* draft: the target's first ``k`` decoder layers, then its final
  norm and LM head (plus embeddings and rotary embedding), as a real Hugging Face causal LM of the target's class.
  Its parameters **are** the target's tensors (no copy, no extra memory); its modules are new objects, so hooks
  or attributes installed on the draft's attention modules (a KV policy, a prefill estimator) do not touch the
  target's, and vice versa.
* :func:`truncated_draft` - an independent, trainable copy of the embeddings, chosen decoder layers, final norm
  and head: the initialisation that :mod:`lightning_modules.speculative.distill` distils into a better draft.
* :class:`DraftConfig` - the typed front door: ``kind=early_exit`` builds the early-exit draft,
  ``kind=checkpoint`` loads a distilled draft (the Hugging Face folder ``<run dir>/draft`` written by the
  ``draft_distill`` recipe, or a Lightning ``.ckpt`` of that run); both are checked against the target with
  :func:`check_draft_compatible` (and :func:`check_same_tokenizer` when tokenizers are at hand).

Every draft takes ``input_ids [B, T]`` and returns logits ``[B, T, V]`` over the target's vocabulary ``V``.
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from lightning_modules.base import check_field, is_int
from lightning_modules.llm.model.surgery import decoder_layers

__all__ = [
    "DRAFT_KINDS",
    "PromptLookupSpec",
    "DRAFT_INFO_FILE",
    "PROBE_TEXT",
    "DraftConfig",
    "early_exit_draft",
    "truncated_draft",
    "evenly_spaced_layers",
    "decoder_layers",
    "check_same_tokenizer",
    "check_draft_compatible",
    "load_draft_checkpoint",
]

DRAFT_KINDS = ("early_exit", "checkpoint", "prompt_lookup")
DRAFT_INFO_FILE = "litctx_draft.json"
"""The provenance file a distilled draft folder carries (target, kept layers, distillation settings)."""

PROBE_TEXT = ("Speculative decoding verifies draft tokens: def f(x):\n\treturn x ** 2  # 12345 caf\u00e9 \u00fcber "
              "\u6771\u4eac <|im_start|>user\nHello!<|im_end|>")
"""A probe string whose token ids must agree between a target and a draft tokenizer."""


# ---------------------------------------------------------------------------------------------- structure
def _check_layers(layers: Sequence[int], total: int, what: str) -> List[int]:
    """``layers`` as a list after checking it names distinct increasing layers of a ``total``-layer target."""
    layers = list(layers)
    if not layers:
        raise ValueError(f"{what}=[]: keep at least one decoder layer (valid: indices 0..{total - 1})")
    if not all(is_int(i) for i in layers):
        raise ValueError(f"{what}={layers}: expected integer layer indices (valid: 0..{total - 1})")
    bad = [i for i in layers if not 0 <= i < total]
    if bad:
        raise ValueError(f"{what}={layers}: index(es) {bad} out of range; the target has {total} decoder layers "
                         f"(valid: 0..{total - 1})")
    if any(b <= a for a, b in zip(layers, layers[1:])):
        raise ValueError(f"{what}={layers}: layer indices must be distinct and increasing")
    return layers


def _check_num_layers(num_layers: Any, total: int) -> None:
    if not is_int(num_layers) or not 1 <= num_layers <= total:
        raise ValueError(f"num_layers={num_layers!r}: the target has {total} decoder layers; valid: 1..{total}")


def evenly_spaced_layers(total: int, num_layers: int) -> List[int]:
    """``num_layers`` evenly spaced indices of ``total`` layers, first and last included (one layer: ``[0]``)."""
    _check_num_layers(num_layers, total)
    if num_layers == 1:
        return [0]
    return [round(i * (total - 1) / (num_layers - 1)) for i in range(num_layers)]


def _draft_config(config: Any, layers: Sequence[int]) -> Any:
    """A copy of ``config`` with ``num_hidden_layers=len(layers)`` and its per-layer lists cut to ``layers``.

    A per-layer list is any list/tuple attribute whose name mentions ``layer`` and whose length is the target's
    layer count (``layer_types`` of Qwen2 and Gemma-3, for example).
    """
    total = config.num_hidden_layers
    out = copy.deepcopy(config)
    for key, value in list(vars(config).items()):
        if "layer" in key and isinstance(value, (list, tuple)) and len(value) == total:
            setattr(out, key, type(value)(value[i] for i in layers))
    out.num_hidden_layers = len(layers)
    return out


def _derive(target: nn.Module, layers: Sequence[int], convert: Callable[[torch.Tensor], torch.Tensor]) -> nn.Module:
    """A model of ``type(target)`` holding the target's embeddings, decoder ``layers`` (renumbered 0..k-1),
    final norm and head, built on the meta device; each of the target's tensors becomes ``convert(tensor)``."""
    prefix, _ = decoder_layers(target)
    position = {src: dst for dst, src in enumerate(layers)}

    def to_draft(key: str) -> Optional[str]:  # target key -> draft key (None: a layer the draft drops)
        if not key.startswith(prefix + "."):
            return key
        index, _, rest = key[len(prefix) + 1:].partition(".")
        if int(index) not in position:
            return None
        return f"{prefix}.{position[int(index)]}.{rest}"

    with torch.device("meta"):
        draft = type(target)(_draft_config(target.config, layers))
    state = {}
    for key, value in target.state_dict(keep_vars=True).items():
        mapped = to_draft(key)
        if mapped is not None:
            state[mapped] = convert(value)
    draft.load_state_dict(state, strict=True, assign=True)
    # non-persistent buffers (the rotary inverse frequencies) are not in the state dict
    source = {to_draft(name): buf for name, buf in target.named_buffers()}
    for name, buf in list(draft.named_buffers()):
        if buf.is_meta:
            owner, _, attr = name.rpartition(".")
            draft.get_submodule(owner)._buffers[attr] = convert(source[name])
    leftover = [name for name, t in list(draft.named_parameters()) + list(draft.named_buffers()) if t.is_meta]
    if leftover:
        raise RuntimeError(f"draft of {type(target).__name__}: tensors {leftover[:5]} were not filled from the target")
    if getattr(target, "generation_config", None) is not None:
        draft.generation_config = copy.deepcopy(target.generation_config)
    return draft


def early_exit_draft(target: nn.Module, num_layers: int) -> nn.Module:
    """The self-speculative draft: the target's first ``num_layers`` decoder layers + final norm + LM head.

    The result is a causal LM of ``type(target)`` (same attention implementation, config copy with
    ``num_hidden_layers=num_layers`` and per-layer lists such as ``layer_types`` cut) whose parameters and
    buffers are the target's own tensors (``data_ptr`` equal; freezing or training one changes the other), but
    whose modules are new objects: hooks and attributes on the draft's modules do not reach the target's.
    ``draft(input_ids [B, T]).logits`` is ``lm_head(norm(h_k)) [B, T, V]`` with ``h_k`` the target's hidden
    state after layer ``k``. The draft is in the target's train/eval mode.

    Raises:
        ValueError: ``num_layers`` is not in ``1..<target layers>``.
    """
    _, target_layers = decoder_layers(target)
    _check_num_layers(num_layers, len(target_layers))
    flags = {id(p): p.requires_grad for p in target.parameters()}
    draft = _derive(target, range(num_layers), lambda t: t)
    for p in target.parameters():  # load_state_dict(assign=True) copies the meta model's requires_grad onto them
        p.requires_grad_(flags[id(p)])
    draft.train(target.training)
    return draft


def truncated_draft(target: nn.Module, num_layers: int, layers: Optional[Sequence[int]] = None) -> nn.Module:
    """An independent, trainable copy of the target's embeddings, ``num_layers`` decoder layers, final norm and
    head (tied embeddings stay tied): the initialisation of a distilled draft.

    Args:
        target: a Hugging Face decoder-only causal LM.
        num_layers: decoder layers to keep.
        layers: which target layers to keep (distinct, increasing indices, ``num_layers`` of them, e.g.
            :func:`evenly_spaced_layers`); default: the first ``num_layers``.

    Returns:
        A causal LM of ``type(target)`` on the target's device and dtype, in eval mode, every parameter its own
        tensor with ``requires_grad=True``; ``draft(input_ids [B, T]).logits`` is ``[B, T, V]``.
    """
    _, target_layers = decoder_layers(target)
    total = len(target_layers)
    _check_num_layers(num_layers, total)
    if layers is None:
        layers = list(range(num_layers))
    layers = _check_layers(layers, total, "layers")
    if len(layers) != num_layers:
        raise ValueError(f"layers={layers}: lists {len(layers)} layer(s) but num_layers={num_layers}")
    clones: Dict[int, torch.Tensor] = {}

    def clone(t: torch.Tensor) -> torch.Tensor:  # one clone per distinct tensor: tied weights stay tied
        if id(t) not in clones:
            data = t.detach().clone()
            clones[id(t)] = nn.Parameter(data, requires_grad=True) if isinstance(t, nn.Parameter) else data
        return clones[id(t)]

    draft = _derive(target, layers, clone)
    draft.requires_grad_(True)
    draft.eval()
    return draft


# ---------------------------------------------------------------------------------------------- compatibility
def check_same_tokenizer(target_tokenizer: Any, draft_tokenizer: Any, probe: str = PROBE_TEXT) -> None:
    """Raise ``ValueError`` unless both tokenizers give identical token ids: the same vocabulary size, the same
    token at every id, the same BOS/EOS/UNK ids and the same ids for ``probe``."""
    nt, nd = len(target_tokenizer), len(draft_tokenizer)
    if nt != nd:
        raise ValueError(f"draft tokenizer has {nd} tokens, the target's has {nt}: a speculative decoder needs "
                         f"identical token ids")
    vt, vd = target_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
    if vt != vd:
        by_id_t = {i: tok for tok, i in vt.items()}
        by_id_d = {i: tok for tok, i in vd.items()}
        for i in sorted(set(by_id_t) | set(by_id_d)):
            if by_id_t.get(i) != by_id_d.get(i):
                raise ValueError(f"draft and target tokenizers differ at token id {i}: the target has "
                                 f"{by_id_t.get(i)!r}, the draft {by_id_d.get(i)!r} (both have {nt} tokens); a "
                                 f"speculative decoder needs identical token ids")
    for attr in ("bos_token_id", "eos_token_id", "unk_token_id"):
        a, b = getattr(target_tokenizer, attr, None), getattr(draft_tokenizer, attr, None)
        if a != b:
            raise ValueError(f"draft and target tokenizers differ in {attr}: target {a}, draft {b}")
    ids_t = list(target_tokenizer.encode(probe, add_special_tokens=False))
    ids_d = list(draft_tokenizer.encode(probe, add_special_tokens=False))
    if ids_t != ids_d:
        at = next((i for i, (a, b) in enumerate(zip(ids_t, ids_d)) if a != b), min(len(ids_t), len(ids_d)))
        raise ValueError(f"draft and target tokenizers encode the probe text differently from token {at}: target "
                         f"{ids_t[at:at + 5]}, draft {ids_d[at:at + 5]} ({len(ids_t)} vs {len(ids_d)} ids)")


def _head_size(model: nn.Module) -> Optional[int]:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    weight = getattr(head, "weight", None)
    return None if weight is None else int(weight.shape[0])


def check_draft_compatible(target: nn.Module, draft: nn.Module) -> None:
    """Raise ``ValueError`` unless ``draft`` scores the target's vocabulary: equal ``config.vocab_size`` and
    equal LM-head output sizes."""
    vt, vd = target.config.vocab_size, draft.config.vocab_size
    if vt != vd:
        raise ValueError(f"draft vocab_size={vd} but the target's vocab_size={vt}: a speculative decoder needs "
                         f"identical token ids")
    ht, hd = _head_size(target), _head_size(draft)
    if ht != hd:
        raise ValueError(f"draft LM head has {hd} outputs but the target's has {ht}: a speculative decoder needs "
                         f"logits over the same vocabulary")


# ---------------------------------------------------------------------------------------------- loading
def _target_attn(target: nn.Module) -> str:
    return getattr(target.config, "_attn_implementation", None) or "sdpa"


def _target_device_dtype(target: nn.Module) -> Tuple[torch.device, torch.dtype]:
    p = next(target.parameters())
    return p.device, p.dtype


def load_draft_checkpoint(path: os.PathLike | str, target: nn.Module) -> Tuple[nn.Module, Dict[str, Any]]:
    """A distilled draft from a Lightning checkpoint of ``DraftDistillModule`` (weights under ``student.*``).

    The architecture is rebuilt as :func:`truncated_draft` of ``target`` with the checkpoint's layer count (and
    its ``layers`` hyperparameter when saved), then the student weights are loaded strictly.
    Returns ``(draft, info)``; ``info`` holds ``layers`` (the target layers it started from, when known) and the
    checkpoint's ``target`` model name.
    """
    from lightning_modules.io import load_checkpoint

    path = Path(path)
    ckpt = load_checkpoint(path)
    state = ckpt.get("state_dict", {})
    student = {k[len("student."):]: v for k, v in state.items() if k.startswith("student.")}
    if not student:
        heads = sorted({k.split(".")[0] for k in state})
        raise ValueError(f"draft.path={str(path)!r}: the checkpoint has no 'student.*' weights (not a draft_distill "
                         f"checkpoint); its state dict starts with {heads[:5]}")
    prefix, _ = decoder_layers(target)
    indices = {int(k[len(prefix) + 1:].split(".")[0]) for k in student if k.startswith(prefix + ".")}
    n = max(indices) + 1 if indices else 0
    hparams = (ckpt.get("hyper_parameters") or {}).get("cfg") or {}
    layers = hparams.get("layers")
    if layers is not None and len(layers) != n:
        layers = None
    total = len(decoder_layers(target)[1])
    if not 1 <= n <= total:
        raise ValueError(f"draft.path={str(path)!r}: the checkpoint's student has {n} decoder layers, the target "
                         f"{total}; valid: 1..{total}")
    draft = truncated_draft(target, n, layers)
    try:
        draft.load_state_dict(student, strict=True)
    except RuntimeError as err:
        raise ValueError(f"draft.path={str(path)!r}: the student weights do not fit a {n}-layer draft of the target "
                         f"{type(target).__name__} ({str(err).splitlines()[0]})") from None
    return draft, {"layers": list(layers) if layers is not None else list(range(n)), "target": hparams.get("model")}


def _load_draft_folder(path: Path, target: nn.Module) -> Tuple[nn.Module, Dict[str, Any]]:
    from transformers import AutoModelForCausalLM

    attn = _target_attn(target)
    if attn == "litctx":
        from lightning_modules.llm.model.attention import ensure_registered

        ensure_registered()
    device, dtype = _target_device_dtype(target)
    draft = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn).to(device)
    info: Dict[str, Any] = {}
    meta = path / DRAFT_INFO_FILE
    if meta.is_file():
        saved = json.loads(meta.read_text(encoding="utf-8"))
        info.update(layers=saved.get("layers"), target=saved.get("target"))
    return draft, info


@dataclass(frozen=True)
class PromptLookupSpec:
    """A model-free draft (what ``DraftConfig(kind="prompt_lookup").build`` returns, and what
    :func:`~lightning_modules.llm.decoding.speculative.speculative_generate` takes as ``draft``): the n-gram lengths
    :class:`~lightning_modules.llm.decoding.speculative.PromptLookupDraft` tries, longest first (defaults: DraftConfig's)."""

    ngram_max: int
    ngram_min: int


@dataclass
class DraftConfig:
    """How a speculative decoder gets its draft model.

    Attributes:
        kind: ``early_exit`` (the target's first ``num_layers`` layers, sharing its weights: no training),
            ``checkpoint`` (a distilled draft from ``path``) or ``prompt_lookup`` (no model: the tokens that followed
            the most recent earlier match of the row's last n-gram, as Hugging Face's prompt lookup decoding).
        num_layers: decoder layers of an ``early_exit`` draft (1..the target's layer count, checked when built);
            a ``checkpoint`` draft has the layer count it was trained with.
        path: ``kind=checkpoint`` only: a local Hugging Face folder (``<run dir>/draft`` of a ``draft_distill``
            run) or a Lightning ``.ckpt`` of that run.
        ngram_max, ngram_min: ``prompt_lookup`` only: the n-gram lengths tried, longest first.
    """

    kind: str = "early_exit"
    num_layers: int = 8
    path: Optional[str] = None
    ngram_max: int = 3
    ngram_min: int = 1

    def __post_init__(self) -> None:
        check_field(self.kind in DRAFT_KINDS, "draft", "kind", self.kind, f"valid kinds are {', '.join(DRAFT_KINDS)}")
        check_field(is_int(self.ngram_min) and self.ngram_min >= 1, "draft", "ngram_min", self.ngram_min,
                    "must be an integer >= 1")
        check_field(is_int(self.ngram_max) and self.ngram_max >= self.ngram_min, "draft", "ngram_max", self.ngram_max,
                    f"must be an integer >= ngram_min ({self.ngram_min})")
        check_field(is_int(self.num_layers) and self.num_layers >= 1, "draft", "num_layers", self.num_layers,
                    "must be an integer >= 1 (and at most the target's layer count)")
        if self.kind == "checkpoint":
            check_field(isinstance(self.path, str) and bool(self.path), "draft", "path", self.path,
                        "kind=checkpoint needs a draft folder (<run dir>/draft of a draft_distill run) or its .ckpt")
        else:
            check_field(self.path is None, "draft", "path", self.path,
                        f"only used with kind=checkpoint (kind={self.kind} builds the draft from the target); "
                        f"set it to null")

    def build(self, target: nn.Module, target_tokenizer: Any = None) -> Tuple[nn.Module, Dict[str, Any]]:
        """``(draft, info)`` for ``target``, checked with :func:`check_draft_compatible` (and, when the target's
        tokenizer is given and the draft folder has one, :func:`check_same_tokenizer`).

        ``info``: ``kind``, ``path``, ``num_layers`` (the draft's), ``target_layers``, ``layers`` (target layers
        the draft started from, None when unknown), ``shares_target_weights``, ``draft_parameters`` (elements
        not shared with the target), ``tokenizer_checked``. A ``checkpoint`` draft is returned frozen in eval
        mode on the target's device and dtype; an ``early_exit`` draft shares the target's parameters as they are.

        Raises:
            ValueError: ``num_layers`` exceeds the target's layers, or the draft is incompatible with the target.
            FileNotFoundError: ``path`` does not exist.
        """
        total = len(decoder_layers(target)[1])
        tokenizer_checked = False
        if self.kind == "prompt_lookup":  # no model: n-gram matches in each row's own tokens
            return PromptLookupSpec(self.ngram_max, self.ngram_min), {
                "kind": self.kind, "ngram_max": self.ngram_max, "ngram_min": self.ngram_min,
                "draft_parameters": 0, "shares_target_weights": False, "tokenizer_checked": True}
        if self.kind == "early_exit":
            if self.num_layers > total:
                raise ValueError(f"draft.num_layers={self.num_layers}: the target has {total} decoder layers; "
                                 f"valid: 1..{total}")
            draft = early_exit_draft(target, self.num_layers)
            info: Dict[str, Any] = {"layers": list(range(self.num_layers))}
            if target_tokenizer is not None:
                tokenizer_checked = True  # the target's own tokenizer
        else:
            path = Path(os.path.expanduser(str(self.path)))
            if path.is_dir():
                if not (path / "config.json").is_file():
                    raise FileNotFoundError(f"draft.path={self.path!r} is a folder without config.json (expected "
                                            f"<run dir>/draft of a draft_distill run, or its .ckpt)")
                draft, info = _load_draft_folder(path, target)
                if target_tokenizer is not None and (path / "tokenizer_config.json").is_file():
                    from transformers import AutoTokenizer

                    check_same_tokenizer(target_tokenizer, AutoTokenizer.from_pretrained(path))
                    tokenizer_checked = True
            elif path.is_file():
                draft, info = load_draft_checkpoint(path, target)
                tokenizer_checked = target_tokenizer is not None  # built on the target: the target's vocabulary
            else:
                raise FileNotFoundError(f"draft.path={self.path!r} does not exist (expected <run dir>/draft of a "
                                        f"draft_distill run, or its .ckpt)")
            draft.requires_grad_(False)
            draft.eval()
        check_draft_compatible(target, draft)
        target_ptrs = {p.data_ptr() for p in target.parameters()}
        own = {p.data_ptr(): p.numel() for p in draft.parameters() if p.data_ptr() not in target_ptrs}
        info.update(kind=self.kind, path=self.path, num_layers=len(decoder_layers(draft)[1]), target_layers=total,
                    shares_target_weights=not own, draft_parameters=sum(own.values()),
                    tokenizer_checked=tokenizer_checked)
        info.setdefault("layers", None)
        return draft, info
