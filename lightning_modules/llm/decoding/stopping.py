"""Stop tokens of a model and its tokenizer: the EOS ids of the generation config and the chat template's turn end
(:func:`stop_token_ids`), which every decoder stops on.
"""

from __future__ import annotations

from typing import Any, List



__all__ = ["stop_token_ids", "line_stop_ids"]


def _eos_ids(source: Any) -> List[int]:
    """``eos_token_id`` (an int, a list of ints or None) of a model's generation config / config, or of a
    ``GenerationConfig`` itself."""
    if source is None:
        return []
    configs = [source] if not hasattr(source, "generation_config") else [source.generation_config,
                                                                          getattr(source, "config", None)]
    for cfg in configs:
        eos = getattr(cfg, "eos_token_id", None)
        if eos is not None:
            return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]
    return []


def _turn_end_ids(tokenizer: Any) -> List[int]:
    """The special tokens the chat template writes after an assistant message (``<|im_end|>`` for SmolLM2,
    ``<end_of_turn>`` for Gemma, ``<|eot_id|>`` for Llama 3): one user + assistant exchange is rendered, and the
    special tokens after the assistant's text are taken. Empty without a chat template."""
    if not getattr(tokenizer, "chat_template", None):
        return []
    marker = "litctx-stop-probe"
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "Hello"},
                                              {"role": "assistant", "content": marker}], tokenize=False)
    except Exception:  # noqa: BLE001 - a template that rejects this exchange has no usable turn end
        return []
    if not isinstance(text, str) or marker not in text:
        return []
    tail = text[text.rindex(marker) + len(marker):]
    special = set(int(i) for i in getattr(tokenizer, "all_special_ids", []))
    for tid, added in getattr(tokenizer, "added_tokens_decoder", {}).items():
        if getattr(added, "special", False):
            special.add(int(tid))
    ids = tokenizer(tail, add_special_tokens=False)["input_ids"]
    return [int(i) for i in ids if int(i) in special]


def stop_token_ids(tokenizer: Any, model_or_generation_config: Any = None) -> List[int]:
    """The token ids that end a greedy answer, sorted: the model's ``generation_config.eos_token_id`` (an int or
    a list; ``config.eos_token_id`` when the generation config has none), the tokenizer's ``eos_token_id``, and
    the special token(s) the chat template writes to close an assistant turn.

    Args:
        tokenizer: a Hugging Face tokenizer (its chat template is rendered once).
        model_or_generation_config: a model (``.generation_config``), a ``GenerationConfig``, or None.
    """
    ids = set(_eos_ids(model_or_generation_config))
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    ids.update(_turn_end_ids(tokenizer))
    return sorted(ids)


def line_stop_ids(tokenizer: Any, model_or_generation_config: Any = None) -> List[int]:
    """:func:`stop_token_ids` plus the newline token: a short answer ends with its line (RAG answers, a claim's
    one-line answers)."""
    newline = tokenizer("\n", add_special_tokens=False)["input_ids"]
    return sorted(set(stop_token_ids(tokenizer, model_or_generation_config)) | {int(i) for i in newline[-1:]})
