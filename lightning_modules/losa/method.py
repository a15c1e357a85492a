"""LoSA (locality-aware sparse attention) and its baselines for the denoising steps of a block-diffusion LM.

Every arm computes a denoising step's attention split in two parts merged by their log-sum-exp
(``litctx_kernels.merge_lse``): the block's queries over the block itself (dense, ``B x B``) and over the committed
prefix, which is where the arms differ:

* ``block_dense`` - the whole prefix for every block query;
* ``block_quest`` - Quest for every block query at every step: each query reads ``budget`` prefix entries of
  its own top pages (page key min / max bounds), so the K/V loaded is the union over the ``B`` queries (KV
  inflation);
* ``block_fixed`` (SparseD-like) - the first step of a block is dense; each query's read set is then fixed to
  its top pages by that step's attention mass and reused at every later step;
* ``losa`` - the first step is dense and its prefix results ``(o^P, lse^P)`` are cached per layer, head and
  block token; at every later step each token's change of its attention input since the previous step (the
  mean squared difference of the layer's hidden states) marks the ``active`` tokens with the largest change
  (or every token whose change reaches ``threshold`` times the largest); only they read the prefix, through
  Quest at ``budget`` entries each, and overwrite their cache entries; stable tokens reuse theirs. The K/V
  loaded is the union over the active tokens only.

Prefill and commit calls (no :data:`~lightning_modules.bdlm.block_sampler.DENOISE_PHASE`) are dense in every arm.
Each denoising call records per layer the union-of-pages density, the K/V bytes read (union entries, in-block
entries, and Quest's page metadata), the active count and the attention time (:class:`BlockSparseSession`).
One typed config per arm (the method pattern): ``cfg.build()`` gives the prefix strategy.
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch

import litctx_kernels
from lightning_modules.bdlm.block_attention import BLOCK_ATTR, block_diffusion_attention
from lightning_modules.bdlm.block_sampler import DENOISE_PHASE, BlockHook
from lightning_modules.llm.runtime.stack import PHASE_ATTR, attach_runners
from lightning_modules.llm.sparse_read.kit import kv_read_bytes
from lightning_modules.losa.sparse import page_density, quest_per_query, top_pages_per_query, union_attention
from litctx_common.timing import Stopwatch

__all__ = ["BlockSparseSession", "BlockSparseRunner", "BlockStepHook", "install_block_sparse"]
















# ---------------------------------------------------------------------------------------------- the state
class LayerState:
    """What one layer keeps across the denoising steps of a block."""

    def __init__(self) -> None:
        self.o: Optional[torch.Tensor] = None  # [B, Hq, n, dv] cached prefix outputs (LoSA)
        self.lse: Optional[torch.Tensor] = None  # [B, Hq, n]
        self.hidden: Optional[torch.Tensor] = None  # [B, n, D] attention input at the last step
        self.read: Optional[torch.Tensor] = None  # [B, Hk, n, P] fixed read sets (SparseD-like)


class BlockSparseSession:
    """Shared by one model's runners: the sampler's position (block, step) and the per-call records.

    ``records``: one dict per denoising call and layer: ``layer``, ``block``, ``step``, ``density`` (mean over rows
    and KV heads of union pages / valid pages; ``density_heads`` per KV head), ``active`` (queries that read the
    prefix), ``queries``, ``bytes`` (K/V of the union and the block + page metadata, ``sparse_read.kv_read_bytes``),
    ``dense_bytes`` (a dense step's K/V), ``seconds``."""

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy
        self.block = -1
        self.step = 0
        self.records: List[Dict[str, Any]] = []

    def summary(self) -> Dict[str, Any]:
        """Means over the recorded denoising calls (all steps, and the later steps only), bytes per denoising
        step (summed over layers) and the active share per layer."""
        recs = self.records
        if not recs:
            return {"calls": 0}
        later = [r for r in recs if r["step"] > 0]
        steps = {(r["block"], r["step"], r.get("sample", 0)) for r in recs}
        by_layer: Dict[int, List[float]] = {}
        for r in later:
            by_layer.setdefault(r["layer"], []).append(r["active"] / r["queries"])
        mean = lambda xs: sum(xs) / len(xs) if xs else None  # noqa: E731
        return {"calls": len(recs), "density": mean([r["density"] for r in recs]),
                "density_later": mean([r["density"] for r in later]),
                "bytes_per_step": sum(r["bytes"] for r in recs) / len(steps),
                "dense_bytes_per_step": sum(r["dense_bytes"] for r in recs) / len(steps),
                "seconds": sum(r["seconds"] for r in recs),
                "active_share_by_layer": {k: mean(v) for k, v in sorted(by_layer.items())}}


# ---------------------------------------------------------------------------------------------- strategies
class DensePrefix:
    """Every query over the whole prefix."""

    def __init__(self, cfg: Any) -> None:  # cfg: losa.config.BlockDenseConfig
        self.cfg = cfg

    def prefix(self, st: LayerState, step: int, query, key, value, valid, scale, hidden
               ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int]:
        """``(o [B, Hq, n, dv], lse [B, Hq, n], read [B, Hk, n, P], active, meta_bytes)``."""
        o, lse = litctx_kernels.attention(query, key, value, scale=scale, causal=False, key_mask=valid)
        n = query.shape[2]
        return o, lse, valid.unsqueeze(2).expand(-1, -1, n, -1), n, 0


class QuestPrefix:
    """Quest for every query at every step."""

    def __init__(self, cfg: Any) -> None:  # cfg: losa.config.BlockQuestConfig
        self.cfg = cfg

    def prefix(self, st, step, query, key, value, valid, scale, hidden):
        read, meta = quest_per_query(query, key, valid, self.cfg.budget, self.cfg.page_size)
        o, lse = union_attention(query, key, value, read, scale)
        return o, lse, read, query.shape[2], meta


class FixedPrefix:
    """Dense first step; each query's top pages by that step's attention mass, reused."""

    def __init__(self, cfg: Any) -> None:  # cfg: losa.config.BlockFixedConfig
        self.cfg = cfg

    def prefix(self, st, step, query, key, value, valid, scale, hidden):
        n = query.shape[2]
        if step == 0 or st.read is None or st.read.shape[2] != n or st.read.shape[-1] != key.shape[2]:
            o, lse = litctx_kernels.attention(query, key, value, scale=scale, causal=False, key_mask=valid)
            st.read = top_pages_per_query(_page_mass(query, key, valid, lse, scale, self.cfg.page_size), valid,
                                          self.cfg.budget, self.cfg.page_size)
            return o, lse, valid.unsqueeze(2).expand(-1, -1, n, -1), n, 0
        o, lse = union_attention(query, key, value, st.read, scale)
        return o, lse, st.read, n, 0


class LoSAPrefix:
    """Cached prefix results for stable tokens, Quest for the active ones."""

    def __init__(self, cfg: Any) -> None:  # cfg: losa.config.LoSAConfig
        self.cfg = cfg

    def select_active(self, change: torch.Tensor) -> torch.Tensor:
        """``change [B, n]`` -> active mask ``[B, n]``: the top ``active`` (ties: the leftmost), or every token at
        or above ``threshold`` x the row's largest change (at least the largest)."""
        b, n = change.shape
        if self.cfg.threshold is not None:
            top = change.amax(-1, keepdim=True)
            act = change >= self.cfg.threshold * top
            act[torch.arange(b), change.argmax(-1)] = True
            return act
        k = min(self.cfg.active, n)
        order = torch.argsort(change, dim=-1, descending=True, stable=True)[:, :k]
        act = torch.zeros(b, n, dtype=torch.bool, device=change.device)
        act[torch.arange(b).unsqueeze(1), order] = True
        return act

    def prefix(self, st, step, query, key, value, valid, scale, hidden):
        b, hq, n, _ = query.shape
        fresh = (step == 0 or st.o is None or st.o.shape[2] != n or st.hidden is None
                 or st.hidden.shape != hidden.shape)
        if fresh:
            o, lse = litctx_kernels.attention(query, key, value, scale=scale, causal=False, key_mask=valid)
            st.o, st.lse, st.hidden = o, lse, hidden
            return o, lse, valid.unsqueeze(2).expand(-1, -1, n, -1), n, 0
        change = (hidden.float() - st.hidden.float()).pow(2).mean(-1)  # [B, n]
        st.hidden = hidden
        act = self.select_active(change)
        k = int(act.sum(-1).max())
        idx = torch.argsort((~act).to(torch.int8), dim=-1, stable=True)[:, :k]  # active tokens first, in order
        live = torch.gather(act, 1, idx)  # rows with fewer active tokens pad with stable ones (not written)
        q_a = torch.gather(query, 2, idx[:, None, :, None].expand(b, hq, k, query.shape[-1]))
        read, meta = quest_per_query(q_a, key, valid, self.cfg.budget, self.cfg.page_size)
        read = read & live[:, None, :, None]
        o_a, lse_a = union_attention(q_a, key, value, read, scale)
        o, lse = st.o.clone(), st.lse.clone()
        w = live[:, None, :].expand(b, hq, k)
        rows = torch.arange(b)[:, None, None].expand(b, hq, k)
        heads = torch.arange(hq)[None, :, None].expand(b, hq, k)
        cols = idx[:, None, :].expand(b, hq, k)
        o[rows[w], heads[w], cols[w]] = o_a[w].to(o.dtype)
        lse[rows[w], heads[w], cols[w]] = lse_a[w].to(lse.dtype)
        st.o, st.lse = o, lse
        return o, lse, read, int(act.sum(-1).float().mean().round()), meta


def _page_mass(query, key, valid, lse, scale, page_size) -> torch.Tensor:
    """Attention mass per page ``[B, Hk, n, n_pages]`` of each query (max over a KV group's heads), from the
    exact probabilities of a dense step."""
    b, hq, n, d = query.shape
    hk, p = key.shape[1], key.shape[2]
    g = hq // hk
    k = key.float().repeat_interleave(g, 1)
    s = (query.float() @ k.transpose(-1, -2)) * scale
    prob = torch.exp(s - lse.float().unsqueeze(-1)).masked_fill(~valid.repeat_interleave(g, 1).unsqueeze(2), 0.0)
    n_pages = -(-p // page_size)
    prob = torch.nn.functional.pad(prob, (0, n_pages * page_size - p)).view(b, hq, n, n_pages, page_size).sum(-1)
    return prob.view(b, hk, g, n, n_pages).amax(2)


# ---------------------------------------------------------------------------------------------- the runner
class BlockSparseRunner:
    """The attention of one layer of a block-diffusion LM (``compute`` role, serves block attention): dense for
    prefill and commit calls, split prefix / block with the session's strategy for denoising calls."""

    serves_block_diffusion = True

    def __init__(self, module: torch.nn.Module, session: BlockSparseSession, model: torch.nn.Module) -> None:
        self.layer = int(module.layer_idx)
        self.session = session
        self.model = model
        self.state = LayerState()
        self.hidden: Optional[torch.Tensor] = None  # the attention input of the current call (pre-hook)

    def reset(self) -> None:
        self.state = LayerState()

    def attend(self, module, query, key, value, attention_mask, scale, window=None) -> torch.Tensor:
        block_state = getattr(module, BLOCK_ATTR)
        if getattr(self.model, PHASE_ATTR, None) != DENOISE_PHASE or block_state.layout is not None:
            return block_diffusion_attention(block_state, query, key, value, attention_mask, scale)
        from lightning_modules.llm.model.attention import mask_to_key_mask

        b, hq, n, _ = query.shape
        hk, n_k = key.shape[1], key.shape[2]
        p = n_k - n
        valid = torch.ones(b, 1, n_k, dtype=torch.bool, device=key.device)
        if attention_mask is not None:
            km = mask_to_key_mask(attention_mask, n, n_k)
            if km is None:
                raise ValueError("block-sparse attention takes padding masks only (causal x per-key)")
            valid = km.bool()
        valid = valid.expand(b, hk, n_k)
        watch = Stopwatch(query.device)
        with watch:
            kb, vb, vb_mask = key[:, :, p:], value[:, :, p:], valid[..., p:]
            o_b, lse_b = litctx_kernels.attention(query, kb, vb, scale=scale, causal=False,
                                           key_mask=None if bool(vb_mask.all()) else vb_mask)
            vp = valid[..., :p]
            hidden = self.hidden if self.hidden is not None else query.transpose(1, 2).reshape(b, n, -1)
            o_p, lse_p, read, active, meta = self.session.strategy.prefix(
                self.state, self.session.step, query, key[:, :, :p], value[:, :, :p], vp, scale, hidden)
            o, _ = litctx_kernels.merge_lse(o_p.to(o_b.dtype), lse_p.to(lse_b.dtype), o_b, lse_b)
        union = read.any(2) & vp
        density = page_density(read & vp.unsqueeze(2), vp, self.session.strategy.cfg.page_size)  # [B, Hk]
        self.session.records.append({
            "layer": self.layer, "block": self.session.block, "step": self.session.step,
            "density": float(density.mean()), "density_heads": density.mean(0).tolist(),
            "active": int(active), "queries": n,
            "bytes": kv_read_bytes(union, key, value, n_new=n) + meta,
            "dense_bytes": kv_read_bytes(vp, key, value, n_new=n), "seconds": watch.seconds})
        return o.to(query.dtype)


class BlockStepHook(BlockHook):
    """Tells the runners where the sampler is: a new block resets their state; each denoising step sets the
    step index."""

    def __init__(self, session: BlockSparseSession, runners: Dict[int, BlockSparseRunner]) -> None:
        self.session, self.runners = session, runners

    def on_block_start(self, decoder, state) -> None:
        self.session.block = int(state.extras.get("block", 0))
        self.session.step = 0
        for r in self.runners.values():
            r.reset()

    def before_step(self, decoder, state) -> None:
        self.session.step = int(state.extras.get("block_step", 0))


@contextlib.contextmanager
def install_block_sparse(model: torch.nn.Module, cfg: Any) -> Iterator[Tuple[BlockSparseSession, BlockStepHook]]:
    """Attach ``cfg``'s strategy to every attention layer of the block-diffusion ``model`` inside the block; yields
    ``(session, hook)``: pass ``hook`` to the sampler. Everything is removed on exit."""
    if not callable(getattr(cfg, "build", None)) or not hasattr(cfg, "label"):
        raise TypeError(f"expected a block-sparse arm config (lightning_modules.losa.config: BLOCK_SPARSE_METHODS), "
                        f"got {type(cfg).__name__}")
    session = BlockSparseSession(cfg.build())
    handles = []

    def make_runner(module):
        runner = BlockSparseRunner(module, session, model)

        def grab(mod, args, kwargs):
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            runner.hidden = hidden if isinstance(hidden, torch.Tensor) and hidden.dim() == 3 else None

        handles.append(module.register_forward_pre_hook(grab, with_kwargs=True))
        return runner

    try:
        with attach_runners(model, make_runner, f"{cfg.method} attention", role="compute") as runners:
            yield session, BlockStepHook(session, runners)
    finally:
        for h in handles:
            h.remove()
