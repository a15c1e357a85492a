"""A block-diffusion language model over any causal LM the loader gives (the ``bdlm`` method).

The model is made block-causal (:mod:`lightning_modules.bdlm.block_attention`: bidirectional inside a block of
``block_size`` columns, causal across blocks) and gets a mask token: the tokenizer's ``mask_token`` (added, and
the embeddings resized, when the vocabulary has none), or ``mask_token_id`` (a reserved id: the synthetic data's).
Initialised from SmolLM2-135M it adapts an autoregressive model (Fast-dLLM v2 / SDAR) and keeps its head
through ``token_shift``; with a ``tiny-*`` model it trains from scratch with the same code.

**Loss** (masked diffusion, MDLM / BD3-LM, vectorised over all blocks in one pass). Per batch, the blocks that
hold scored tokens (``loss_mask``; every block for plain text) are noised: per row and block a mask ratio
``t ~ U(t_min, 1)``, each scored token replaced by ``[MASK]`` with probability ``t``. The model reads the clean
sequence ``x_0`` followed by the noised copies ``x_t`` under :func:`~lightning_modules.bdlm.block_attention.
training_layout` (the copy of block ``c`` reads clean blocks ``< c`` and itself), and the loss is the
cross-entropy on the masked tokens weighted ``1 / t``, summed and divided by the number of scored tokens (the
negative ELBO per token). The output head runs only on the masked positions.

**Evaluation** (batches of :mod:`datamodules.synth.multi_key`: a prompt, then an answer region starting on a
block boundary): the loss at a fixed noise draw, and the answer sampled by :class:`~lightning_modules.llm.
block_sampler.BlockDiffusionSampler`: ``{stage}/exact_match`` (the whole answer right) and ``{stage}/token_acc``
(answer positions right), per context length as ``..._len{T}`` when there are several.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

from lightning_modules.base import check_field, coerce_config
from lightning_modules.bdlm.block_attention import (BlockDiffusionSetting, apply_block_diffusion, block_setting,
                                                   training_forward, training_layout)
from lightning_modules.bdlm.block_sampler import BlockSamplerConfig, block_generate
from lightning_modules.llm.model.lm import LanguageModel, LanguageModelConfig
from litctx_common.options import nested_config

__all__ = ["BlockDiffusionLMConfig", "BlockDiffusionLM", "noise_blocks", "diffusion_loss"]


@dataclass
class BlockDiffusionLMConfig(LanguageModelConfig):
    """:class:`LanguageModelConfig` plus:

    Attributes:
        block_size: ``B``, tokens per block; null = the data's (``method_hints``), else 16 (SDAR / Trado and
            LoSA's default).
        mask_token: the tokenizer's mask token (added to the vocabulary when missing; ignored with
            ``mask_token_id``).
        mask_token_id: a reserved id inside the vocabulary to use as the mask (the synthetic data's, filled from
            the data when null); null = ``mask_token``.
        vocab_size: the vocabulary of a ``tiny-*`` model (filled from synthetic data); null = the tokenizer's.
        token_shift: predict the token at column ``c`` from the output at ``c - 1`` (keeps an AR model's head);
            false = from ``c`` (MDLM).
        t_min: the lowest mask ratio drawn (``t ~ U(t_min, 1)``; the weight ``1 / t`` is at most ``1 / t_min``).
        num_layers: keep only the model's first ``num_layers`` decoder layers (an independent copy with the
            embeddings, final norm and head: a smaller model initialised from a pretrained one, for CPU budgets);
            null = all.
        sampler: the evaluation sampler (:class:`BlockSamplerConfig`: ``steps`` per block, ``threshold``, ...).
        eval_sampling: sample answers in validation / test (exact match); false = the loss only.
    """

    block_size: Optional[int] = None
    mask_token: str = "<|mask|>"
    mask_token_id: Optional[int] = None
    vocab_size: Optional[int] = None
    token_shift: bool = True
    t_min: float = 1e-3
    num_layers: Optional[int] = None
    sampler: BlockSamplerConfig = field(default_factory=BlockSamplerConfig)
    eval_sampling: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        o = "bdlm"
        check_field(self.block_size is None or (isinstance(self.block_size, int) and not isinstance(
            self.block_size, bool) and self.block_size >= 1), o, "block_size", self.block_size,
            "must be null or an integer >= 1")
        check_field(self.mask_token_id is None or (isinstance(self.mask_token_id, int) and self.mask_token_id >= 0),
                    o, "mask_token_id", self.mask_token_id, "must be null or a token id >= 0")
        check_field(self.vocab_size is None or (isinstance(self.vocab_size, int) and self.vocab_size >= 2),
                    o, "vocab_size", self.vocab_size, "must be null or an integer >= 2")
        check_field(isinstance(self.mask_token, str) and bool(self.mask_token), o, "mask_token", self.mask_token,
                    "must be a non-empty token string")
        check_field(isinstance(self.t_min, (int, float)) and 0.0 < self.t_min < 1.0, o, "t_min", self.t_min,
                    "must be in (0, 1)")
        check_field(isinstance(self.token_shift, bool), o, "token_shift", self.token_shift, "must be true or false")
        check_field(self.num_layers is None or (isinstance(self.num_layers, int) and not isinstance(
            self.num_layers, bool) and self.num_layers >= 1), o, "num_layers", self.num_layers,
            "must be null or an integer >= 1")
        self.sampler = nested_config(self.sampler, BlockSamplerConfig, "bdlm.sampler")
        if self.vocab_size is not None and not str(self.model).lower().startswith("tiny-"):
            raise ValueError(f"bdlm.vocab_size={self.vocab_size}: only a tiny-* model takes a vocabulary size; "
                             f"{self.model!r} brings its own")

    DEFAULT_BLOCK = 16

    @property
    def block(self) -> int:
        """The block size in use (``block_size``, or 16 when neither the config nor the data set one)."""
        return self.DEFAULT_BLOCK if self.block_size is None else int(self.block_size)

    @property
    def sampler_config(self) -> BlockSamplerConfig:
        return self.sampler


def noise_blocks(input_ids: torch.Tensor, loss_mask: torch.Tensor, block: int, mask_id: int, t_min: float,
                 generator: Optional[torch.Generator] = None) -> Dict[str, torch.Tensor]:
    """Draw the noised copies of the blocks holding scored tokens.

    Args:
        input_ids, loss_mask: ``[B, T]`` with ``T`` a multiple of ``block``.

    Returns ``blocks [nb]`` (clean block indices), ``cols [nb * block]`` (their columns), ``t [B, nb]``,
    ``masked [B, nb, block]`` (scored tokens replaced by the mask) and ``x_t [B, nb * block]``."""
    b, n = input_ids.shape
    if n % block:
        raise ValueError(f"input_ids has {n} columns, not a multiple of the block size {block}")
    scored = loss_mask.view(b, n // block, block)
    blocks = scored.any(-1).any(0).nonzero().flatten()
    cols = (blocks.unsqueeze(1) * block + torch.arange(block, device=blocks.device)).flatten()
    nb = int(blocks.numel())
    dev = input_ids.device
    t = t_min + (1.0 - t_min) * torch.rand(b, nb, generator=generator, device=dev)
    u = torch.rand(b, nb, block, generator=generator, device=dev)
    masked = scored[:, blocks] & (u < t.unsqueeze(-1))
    x_t = input_ids[:, cols].view(b, nb, block).masked_fill(masked, mask_id).view(b, nb * block)
    return {"blocks": blocks, "cols": cols, "t": t, "masked": masked, "x_t": x_t}


def _positions(attention_mask: torch.Tensor) -> torch.Tensor:
    return (attention_mask.long().cumsum(-1) - 1).clamp_min(0)


def diffusion_loss(model: torch.nn.Module, batch: Dict[str, torch.Tensor], setting: BlockDiffusionSetting,
                   t_min: float, generator: Optional[torch.Generator] = None) -> Tuple[torch.Tensor, Dict[str, Any]]:
    """The masked-diffusion loss of ``batch`` (``input_ids``, optional ``attention_mask`` / ``loss_mask``
    ``[B, T]``, ``T`` a multiple of the block size) in one forward of ``[x_0 ; x_t]``. Returns ``(loss, info)``
    with ``info``: ``masked`` (tokens scored), ``correct`` (their argmax right), ``scored``."""
    ids = batch["input_ids"]
    b, n = ids.shape
    attn = batch.get("attention_mask")
    attn = torch.ones_like(ids) if attn is None else attn.to(ids.device)
    loss_mask = batch.get("loss_mask")
    loss_mask = attn.bool() if loss_mask is None else (loss_mask.to(ids.device).bool() & attn.bool())
    blk = setting.block_size
    if setting.token_shift:  # column 0 has no column before it: it cannot be predicted
        loss_mask = loss_mask.clone()
        loss_mask[:, 0] = False
    nz = noise_blocks(ids, loss_mask, blk, setting.mask_token_id, t_min, generator)
    cols, nb = nz["cols"], int(nz["blocks"].numel())
    pos = _positions(attn)
    inp = torch.cat([ids, nz["x_t"]], 1)
    position_ids = torch.cat([pos, pos[:, cols]], 1)
    key_mask = torch.cat([attn, attn[:, cols]], 1).bool()
    layout = training_layout(n, nz["blocks"].tolist(), blk, device=ids.device)
    backbone = getattr(model, model.base_model_prefix)
    with training_forward(model, layout, key_mask):
        hidden = backbone(input_ids=inp, position_ids=position_ids, use_cache=False).last_hidden_state
    # where the prediction of each noised position comes from: [nb * blk] indices into the 2-part sequence
    offs = torch.arange(nb * blk, device=ids.device)
    src = n + offs  # MDLM: the position itself
    if setting.token_shift:
        src = torch.where(offs % blk == 0, cols - 1, n + offs - 1)
    masked = nz["masked"].view(b, nb * blk)
    rows, where = masked.nonzero(as_tuple=True)
    scored = int(loss_mask[:, cols].sum()) if nb else 0
    if rows.numel() == 0:
        zero = hidden.sum() * 0.0
        return zero, {"masked": 0, "correct": 0, "scored": scored}
    logits = model.get_output_embeddings()(hidden[rows, src[where]]).float()
    logits[:, setting.mask_token_id] = float("-inf")
    target = ids[:, cols][rows, where]
    ce = F.cross_entropy(logits, target, reduction="none")
    weight = 1.0 / nz["t"].repeat_interleave(blk, dim=1)[rows, where]
    loss = (ce * weight).sum() / max(1, scored)
    correct = int((logits.argmax(-1) == target).sum())
    return loss, {"masked": int(rows.numel()), "correct": correct, "scored": scored}


class BlockDiffusionLM(LanguageModel):
    """Block-diffusion training and evaluation (see the module docstring)."""

    config_class = BlockDiffusionLMConfig

    def __init__(self, cfg: Any = None, optim: Any = None) -> None:
        cfg = coerce_config(cfg, BlockDiffusionLMConfig)
        if cfg.vocab_size is not None:
            cfg.tiny = {**dict(cfg.tiny or {}), "vocab_size": int(cfg.vocab_size)}
        super().__init__(cfg, optim)
        self.sampler_hooks: List[Any] = []  # decoding hooks callbacks attach to the evaluation sampler (LoSA)

    # ------------------------------------------------------------------ the model
    def modify_model(self) -> None:
        if self.cfg.num_layers is not None:
            from lightning_modules.llm.decoding.drafts import truncated_draft
            from lightning_modules.llm.model.surgery import decoder_layers

            total = len(decoder_layers(self.model)[1])
            if self.cfg.num_layers > total:
                raise ValueError(f"bdlm.num_layers={self.cfg.num_layers}: {self.cfg.model} has {total} decoder layers")
            if self.cfg.num_layers < total:
                self.model = truncated_draft(self.model, self.cfg.num_layers)
        have = block_setting(self.model) or _saved_setting(self.model)
        if have is not None:
            if ((self.cfg.block_size is not None and have.block_size != self.cfg.block_size)
                    or have.token_shift != self.cfg.token_shift):
                raise ValueError(f"{self.cfg.model} is a block-diffusion LM with block_size={have.block_size}, "
                                 f"token_shift={have.token_shift}; method.args ask for block_size="
                                 f"{self.cfg.block_size}, token_shift={self.cfg.token_shift}")
            apply_block_diffusion(self.model, have)
            return
        mask_id = self.cfg.mask_token_id
        if mask_id is None:
            mask_id = self._add_mask_token()
        vocab = self.model.get_input_embeddings().weight.shape[0]
        if mask_id >= vocab:
            raise ValueError(f"bdlm.mask_token_id={mask_id} is outside the model's {vocab}-id vocabulary "
                             f"({self.cfg.model}); set vocab_size (tiny models) or leave mask_token_id null")
        apply_block_diffusion(self.model, BlockDiffusionSetting(self.cfg.block, int(mask_id),
                                                                self.cfg.token_shift))

    def _add_mask_token(self) -> int:
        tok = self.tokenizer
        if tok is None:
            raise ValueError(f"{self.cfg.model} has no tokenizer to add {self.cfg.mask_token!r} to: set "
                             f"method.args.mask_token_id to a reserved id")
        if self.cfg.mask_token not in tok.get_vocab():
            tok.add_special_tokens({"mask_token": self.cfg.mask_token})
        else:
            tok.mask_token = self.cfg.mask_token
        mask_id = int(tok.convert_tokens_to_ids(self.cfg.mask_token))
        vocab = self.model.get_input_embeddings().weight.shape[0]
        if mask_id >= vocab:  # a new row: the mean embedding (transformers' default initialisation of new rows)
            self.model.resize_token_embeddings(mask_id + 1, mean_resizing=True)
        return mask_id

    @property
    def setting(self) -> BlockDiffusionSetting:
        found = block_setting(self.model)
        assert found is not None  # set by modify_model
        return found

    # ------------------------------------------------------------------ training
    def training_loss(self, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
        loss, info = diffusion_loss(self.model, batch, self.setting, self.cfg.t_min)
        if info["masked"]:
            self.log("train/masked_acc", info["correct"] / info["masked"], batch_size=batch["input_ids"].shape[0])
        return loss

    # ------------------------------------------------------------------ evaluation
    def eval_step(self, stage: str, batch: Dict[str, Any]) -> None:
        ids = batch["input_ids"]
        lengths = batch.get("length")
        length = int(lengths[0]) if lengths is not None else int(ids.shape[1])
        primary = self._primary.setdefault(stage, length)
        suffix = "" if length == primary else f"_len{length}"
        gen = torch.Generator(device=ids.device).manual_seed(int(self.cfg.seed) * 7919 + int(ids.shape[1]))
        loss, _ = diffusion_loss(self.model, batch, self.setting, self.cfg.t_min, generator=gen)
        kw = dict(batch_size=ids.shape[0], sync_dist=True, add_dataloader_idx=False)
        self.log(f"{stage}/loss{suffix}", loss, prog_bar=stage == "val" and not suffix, **kw)
        if not self.cfg.eval_sampling or "prompt_len" not in batch:
            return
        exact, token_acc = self.sample_scores(batch)
        self.log(f"{stage}/exact_match{suffix}", exact.mean(), **kw)
        self.log(f"{stage}/token_acc{suffix}", token_acc.mean(), **kw)

    def eval_epoch_end(self, stage: str) -> None:
        self._primary.pop(stage, None)

    def sample_answers(self, batch: Dict[str, Any], hooks=()) -> List[List[int]]:
        """Sample each row's answer after its prompt (``batch["input_ids"][:, :prompt_len]``), with the attached
        :attr:`sampler_hooks` and ``hooks``."""
        p, a = int(batch["prompt_len"]), int(batch["answer_len"])
        ids, attn = batch["input_ids"], batch["attention_mask"]
        pad = int(batch.get("pad_id", 0))
        result = block_generate(self.model, ids[:, :p], attn[:, :p], a, stop_ids=[int(batch["eos_id"])],
                                cfg=self.cfg.sampler_config, hooks=list(self.sampler_hooks) + list(hooks), pad_id=pad)
        return result.tokens

    def sample_scores(self, batch: Dict[str, Any], hooks=()) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(exact [B], token_acc [B])`` of the sampled answers against the batch's answers."""
        tokens = self.sample_answers(batch, hooks)
        return score_answers(tokens, batch)


def score_answers(tokens: List[List[int]], batch: Dict[str, Any]) -> Tuple[torch.Tensor, torch.Tensor]:
    """Exact match (the generated tokens, stop excluded, equal the answer) and the share of answer positions
    right, per row, against ``batch`` (``input_ids`` after ``prompt_len``, ``n_answer`` real tokens per row)."""
    p = int(batch["prompt_len"])
    exact, acc = [], []
    for b, toks in enumerate(tokens):
        n = int(batch["n_answer"][b])
        ref = batch["input_ids"][b, p:p + n].tolist()
        exact.append(float(list(toks) == ref))
        acc.append(sum(1.0 for i, r in enumerate(ref) if i < len(toks) and toks[i] == r) / max(1, n))
    return torch.tensor(exact), torch.tensor(acc)


def _saved_setting(model: torch.nn.Module) -> Optional[BlockDiffusionSetting]:
    from lightning_modules.bdlm.block_attention import CONFIG_KEY

    saved = getattr(model.config, CONFIG_KEY, None)
    return BlockDiffusionSetting.from_hf(saved) if saved else None
