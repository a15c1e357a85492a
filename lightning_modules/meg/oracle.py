"""How predictable is a masked block's code from short and from long context? A code oracle for MEG-XL's data.

MEG-XL masks blocks of ``block_s`` (3 s) in a long context and predicts their tokenizer codes. Whether that
objective can teach anything, and whether a long context can teach more than a short one, is a property of the
data and the tokenizer, which this oracle measures without any network:

* **Blocks.** Each context window (as :class:`datamodules.meg.MEGDataModule` serves it: ``meg [C, S]`` robustly
  scaled, ``sensor_mask [C]``) is tokenised per real channel by a fitted
  :class:`~lightning_modules.meg.tokenizer.RVQTokenizer`; its tokens are cut into sub-segments as MEG-XL's mask
  does (:func:`~lightning_modules.meg.model.masking_plan`: ``S / (subsegment_s * sfreq)`` sub-segments of
  ``n_tokens // n_sub`` tokens), and the first ``block_s * sfreq // stride`` tokens of every sub-segment form one
  block (every sub-segment is scored, one at a time). A block of a channel is one example; its target is the
  level-``level`` codes of its tokens (a count vector ``[V]``).
* **Features** of a (window, channel, block), from that channel's codes only:
  ``short``: the codes of the ``short_s * sfreq / stride`` tokens on each side of the block (+-1 s: 4 tokens),
  one-hot per position (``V + 1`` values: a code, or "outside the window"), ``2 k (V + 1)`` features;
  ``long``: the histogram of the codes of every token of the window outside the block (150 s), as log
  frequencies (add-``smoothing`` counts), ``V`` features; ``both``: the two side by side.
* **Predictor**: multinomial logistic regression ``p(code | x) = softmax(W z(x) + b)`` on standardised features
  ``z`` (training mean and sd), fitted on the training blocks by full-batch L-BFGS in float64 to convergence,
  minimising the mean cross-entropy per target token plus ``l2 / 2 * ||W||^2`` (the bias is not penalised).
  Every token of a block gets the same predicted distribution: the oracle predicts "a code of the block", not
  its position inside it. Deterministic: no sampling anywhere.
* **Score**: cross-entropy in nats per masked token on the held-out windows, and its gain over the **marginal**:
  the training codes' frequencies (add-``smoothing`` counts, so an unseen code costs a finite amount) scored on
  the same held-out tokens. ``gain[kind] = ce_marginal - ce[kind]``; a long context is more informative than the
  short one when ``gain["long"] > gain["short"]``.

Use::

    result = code_oracle(dm.split("train"), dm.split("val"), tokenizer, OracleConfig(sfreq=50.0))
    result.gain  # {"short": ..., "long": ..., "both": ...} nats below the marginal
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch

from lightning_modules.meg.model import masking_plan

__all__ = ["OracleConfig", "OracleResult", "BlockData", "KINDS", "window_codes", "block_data", "design",
           "WordStateProbe", "state_design", "topk_accuracy", "word_state_probe",
           "fit_softmax", "log_proba", "cross_entropy", "marginal_log_proba", "code_oracle"]

KINDS = ("short", "long", "both")
"""The oracles: the +-``short_s`` neighbours, the ``long`` window histogram, and ``both`` together."""


@dataclass
class OracleConfig:
    """Where the blocks are, what each oracle sees, and the predictor's fixed regularisation."""

    sfreq: float = 50.0
    """Sampling rate of the windows (the DataModule's ``sfreq``)."""
    block_s: float = 3.0
    """Masked block length (MEG-XL's ``mask_s``); at most one sub-segment."""
    subsegment_s: float = 3.0
    """The windows are cut into sub-segments of this length, each holding one candidate block."""
    short_s: float = 1.0
    """The short oracle sees this many seconds of the channel's codes on each side of the block."""
    level: int = 0
    """Which residual level's codes are predicted (and used as features)."""
    l2: float = 1e-3
    """L2 strength on the weights of the standardised features, per target token (fixed, not tuned)."""
    smoothing: float = 0.5
    """Additive count of every code in the marginal (0.5: Jeffreys)."""
    max_iter: int = 1000
    tolerance_grad: float = 1e-6

    def __post_init__(self) -> None:
        problems = []
        if self.sfreq <= 0:
            problems.append(f"sfreq={self.sfreq}: must be > 0")
        if not 0 < self.block_s <= self.subsegment_s:
            problems.append(f"block_s={self.block_s}: must be in (0, subsegment_s={self.subsegment_s}]")
        if self.short_s <= 0:
            problems.append(f"short_s={self.short_s}: must be > 0")
        if self.level < 0:
            problems.append(f"level={self.level}: must be >= 0")
        if self.l2 < 0 or self.smoothing < 0:
            problems.append(f"l2={self.l2}, smoothing={self.smoothing}: must be >= 0")
        if self.max_iter < 1:
            problems.append(f"max_iter={self.max_iter}: must be >= 1")
        if problems:
            raise ValueError("OracleConfig: " + "; ".join(problems))

    def layout(self, n_samples: int, n_tokens: int, stride: int) -> Tuple[np.ndarray, int, int]:
        """``(block starts [n_blocks] (token index), block_len, short_len)`` for windows of ``n_samples``
        samples tokenised into ``n_tokens`` tokens of ``stride`` samples."""
        n_sub = max(1, n_samples // max(1, int(round(self.subsegment_s * self.sfreq))))
        mask_tokens = max(1, int(round(self.block_s * self.sfreq)) // stride)
        n_sub, sub_len, block_len, _ = masking_plan(n_tokens, n_sub, mask_tokens, 1.0)
        short_len = max(1, int(round(self.short_s * self.sfreq / stride)))
        return np.arange(n_sub) * sub_len, block_len, short_len


@dataclass
class BlockData:
    """The examples of a set of windows: ``N`` blocks (window, channel, sub-segment), ``V`` codes.

    ``short [N, 2k]`` int64: the codes of the ``k`` tokens before and the ``k`` after the block (``V``: outside
    the window); ``hist [N, V]``: counts of the codes of the window's other tokens; ``counts [N, V]``: the
    block's own codes (the targets)."""

    short: np.ndarray
    hist: np.ndarray
    counts: np.ndarray

    def __len__(self) -> int:
        return int(self.counts.shape[0])


@dataclass
class OracleResult:
    """Cross-entropies (nats per masked token) on the held-out blocks and gains below the marginal."""

    marginal: float
    ce: Dict[str, float]
    gain: Dict[str, float]
    codes: int
    train_blocks: int
    test_blocks: int
    test_tokens: int
    config: Dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> Dict[str, Any]:
        return asdict(self)


def window_codes(windows: Iterable[Mapping[str, torch.Tensor]], tokenizer, level: int = 0) -> List[np.ndarray]:
    """Level-``level`` codes ``[C_real, T']`` (int64) of each window's real channels (``meg [C, S]`` restricted
    to ``sensor_mask [C]``), encoded by the fitted ``tokenizer``."""
    if not 0 <= level < tokenizer.levels:
        raise ValueError(f"level={level}: the tokenizer has levels 0..{tokenizer.levels - 1}")
    out = []
    for item in windows:
        meg = item["meg"]
        if "sensor_mask" in item:
            meg = meg[item["sensor_mask"].bool()]
        out.append(tokenizer.encode(meg.float())[:, level].cpu().numpy().astype(np.int64))
    return out


def block_data(codes: Sequence[np.ndarray], n_codes: int, starts: np.ndarray, block_len: int,
               short_len: int) -> BlockData:
    """The examples of every block ``[s, s + block_len)`` (``s`` in ``starts``) of every channel of every
    window ``codes[i] [C, T']`` (values in ``[0, n_codes)``); see :class:`BlockData`."""
    shorts, hists, counts = [], [], []
    for c in codes:
        c = np.asarray(c, dtype=np.int64)
        C, T = c.shape
        if c.size and (c.min() < 0 or c.max() >= n_codes):
            raise ValueError(f"codes outside [0, {n_codes})")
        padded = np.full((C, T + 2 * short_len), n_codes, dtype=np.int64)
        padded[:, short_len:short_len + T] = c
        onehot = np.zeros((C, T, n_codes))
        np.put_along_axis(onehot, c[..., None], 1.0, axis=-1)
        total = onehot.sum(1)  # [C, V]
        for s in starts:
            if s + block_len > T:
                continue
            inside = onehot[:, s:s + block_len].sum(1)
            left = padded[:, s:s + short_len]  # tokens s - k .. s - 1
            right = padded[:, s + block_len + short_len:s + block_len + 2 * short_len]
            shorts.append(np.concatenate([left, right], axis=1))
            hists.append(total - inside)
            counts.append(inside)
    if not counts:
        raise ValueError("no complete block in the windows: they are shorter than one block")
    return BlockData(np.concatenate(shorts), np.concatenate(hists), np.concatenate(counts))


def design(data: BlockData, kind: str, n_codes: int, smoothing: float = 0.5) -> np.ndarray:
    """The feature matrix ``[N, D]`` (float64) of oracle ``kind`` (:data:`KINDS`): ``short`` one-hot per
    neighbour position ``[N, 2k (V + 1)]``, ``long`` the log of the histogram's frequencies (each count raised
    by ``smoothing``) ``[N, V]``, ``both`` the two concatenated. With the log, weights ``W = I`` turn ``long``
    into the window's own code frequencies, so the oracle contains that plug-in predictor."""
    if kind not in KINDS:
        raise ValueError(f"oracle kind={kind!r}: expected one of {KINDS}")
    parts = []
    if kind in ("short", "both"):
        n, width = data.short.shape
        onehot = np.zeros((n, width, n_codes + 1))
        np.put_along_axis(onehot, data.short[..., None], 1.0, axis=-1)
        parts.append(onehot.reshape(n, -1))
    if kind in ("long", "both"):
        hist = np.asarray(data.hist, dtype=np.float64) + smoothing
        parts.append(np.log(hist / hist.sum(1, keepdims=True)))
    return np.concatenate(parts, axis=1)


def marginal_log_proba(counts: np.ndarray, smoothing: float = 0.5) -> np.ndarray:
    """``[V]`` log frequencies of the codes in ``counts [N, V]`` (summed over rows), each code's count raised
    by ``smoothing``."""
    total = np.asarray(counts, dtype=np.float64).sum(0) + smoothing
    return np.log(total / total.sum())


def cross_entropy(logp: np.ndarray, counts: np.ndarray) -> float:
    """Mean cross-entropy (nats per token) of predicted log-probabilities ``logp [N, V]`` (or ``[V]`` for every
    row) against target code counts ``counts [N, V]``."""
    counts = np.asarray(counts, dtype=np.float64)
    logp = np.broadcast_to(logp, counts.shape)
    return float(-(counts * logp).sum() / counts.sum())


def fit_softmax(x: np.ndarray, counts: np.ndarray, l2: float, max_iter: int = 1000,
                tolerance_grad: float = 1e-6, init_bias: Optional[np.ndarray] = None,
                unpenalized: int = 0) -> Tuple[np.ndarray, np.ndarray]:
    """Multinomial logistic regression ``softmax(x @ W + b)`` fitted to target counts ``counts [N, V]`` from
    features ``x [N, D]``: minimises ``-sum(counts * log p) / sum(counts) + l2 / 2 * ||W||^2`` by full-batch
    L-BFGS (strong Wolfe line search) in float64, from ``W = 0`` and ``b = init_bias`` (default 0), until the
    largest gradient entry is at most ``tolerance_grad`` (or ``max_iter`` iterations). The weights of the last
    ``unpenalized`` features are left out of the penalty (like the bias: e.g. indicator columns whose log-odds should
    not shrink). Returns ``(W [D, V], b [V])``."""
    X = torch.as_tensor(np.asarray(x, dtype=np.float64))
    Y = torch.as_tensor(np.asarray(counts, dtype=np.float64))
    weight = torch.zeros(X.shape[1], Y.shape[1], dtype=torch.float64, requires_grad=True)
    bias = torch.as_tensor(np.zeros(Y.shape[1]) if init_bias is None else np.asarray(init_bias, np.float64))
    bias = bias.clone().requires_grad_(True)
    total = float(Y.sum())
    opt = torch.optim.LBFGS([weight, bias], lr=1.0, max_iter=max_iter, tolerance_grad=tolerance_grad,
                            tolerance_change=1e-12, history_size=20, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        logp = torch.log_softmax(X @ weight + bias, dim=1)
        penalised = weight[: weight.shape[0] - unpenalized]
        loss = -(Y * logp).sum() / total + 0.5 * l2 * (penalised * penalised).sum()
        loss.backward()
        return loss

    for _ in range(20):  # L-BFGS may stop early on a tiny change of the loss: restart until the gradient is small
        opt.step(closure)
        grad = max(float(weight.grad.abs().max()), float(bias.grad.abs().max()))
        if grad <= tolerance_grad or opt.state[weight]["n_iter"] >= max_iter:
            break
    return weight.detach().numpy(), bias.detach().numpy()


def log_proba(x: np.ndarray, weight: np.ndarray, bias: np.ndarray) -> np.ndarray:
    """``[N, V]`` log-probabilities of :func:`fit_softmax`'s model."""
    z = np.asarray(x, dtype=np.float64) @ weight + bias
    z = z - z.max(1, keepdims=True)
    return z - np.log(np.exp(z).sum(1, keepdims=True))


def _standardise(train: np.ndarray, test: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    mean = train.mean(0)
    sd = train.std(0)
    sd[sd < 1e-12] = 1.0
    return (train - mean) / sd, (test - mean) / sd


def code_oracle(train: Any, test: Any, tokenizer, cfg: Optional[OracleConfig] = None,
                kinds: Sequence[str] = KINDS) -> OracleResult:
    """Fit the oracles on the ``train`` windows and score them on the ``test`` windows (see the module
    docstring).

    Args:
        train, test: windows as :class:`datamodules.meg.MEGDataModule` serves them (``dm.split("train")``; any
            sequence of dicts with ``meg [C, S]`` and optionally ``sensor_mask [C]``), or lists of precomputed
            codes ``[C, T']`` (int arrays) from :func:`window_codes`.
        tokenizer: a fitted :class:`~lightning_modules.meg.tokenizer.RVQTokenizer` (its ``stride`` and
            ``codes`` define the tokens).
        cfg: where the blocks are and the predictor's settings.
        kinds: which oracles to fit (:data:`KINDS`).

    Returns:
        :class:`OracleResult`: ``marginal`` and ``ce[kind]`` in nats per held-out masked token, ``gain[kind] =
        marginal - ce[kind]``.
    """
    cfg = cfg or OracleConfig()
    V, stride = int(tokenizer.codes), int(tokenizer.stride)

    def codes_of(windows) -> List[np.ndarray]:
        windows = list(windows)
        if windows and isinstance(windows[0], np.ndarray):
            return windows
        return window_codes(windows, tokenizer, cfg.level)

    train_codes, test_codes = codes_of(train), codes_of(test)
    if not train_codes or not test_codes:
        raise ValueError(f"code_oracle needs training and held-out windows, got {len(train_codes)} and "
                         f"{len(test_codes)}")
    n_tokens = train_codes[0].shape[1]
    starts, block_len, short_len = cfg.layout(n_tokens * stride, n_tokens, stride)
    tr = block_data(train_codes, V, starts, block_len, short_len)
    te = block_data(test_codes, V, starts, block_len, short_len)
    prior = marginal_log_proba(tr.counts, cfg.smoothing)
    marginal = cross_entropy(prior, te.counts)
    ce: Dict[str, float] = {}
    for kind in kinds:
        xtr, xte = _standardise(design(tr, kind, V, cfg.smoothing), design(te, kind, V, cfg.smoothing))
        weight, bias = fit_softmax(xtr, tr.counts, cfg.l2, cfg.max_iter, cfg.tolerance_grad, init_bias=prior)
        ce[kind] = cross_entropy(log_proba(xte, weight, bias), te.counts)
    return OracleResult(marginal=marginal, ce=ce, gain={k: marginal - v for k, v in ce.items()}, codes=V,
                        train_blocks=len(tr), test_blocks=len(te), test_tokens=int(te.counts.sum()),
                        config=asdict(cfg))


# ---------------------------------------------------------------------------------------------- gate (b)
@dataclass
class WordStateProbe:
    """Top-``k`` word decoding on held-out words by a probe that sees each word's window alone and by one that
    also knows the true slow state at the word (MEG-XL's gate (b): context can help decoding only if the
    second is clearly better)."""

    window: float
    window_state: float
    k: int
    chance: float
    train_words: int
    test_words: int
    states: int
    l2: float

    @property
    def gain(self) -> float:
        return self.window_state - self.window

    def as_dict(self) -> Dict[str, Any]:
        return {**asdict(self), "gain": self.gain}


def state_design(x: np.ndarray, states: np.ndarray, n_states: int) -> np.ndarray:
    """``[N, D + D * n_states + n_states]``: the features ``x [N, D]``, then ``x`` again in the block of each row's
    state ``states [N]`` (zeros in the other blocks), then the state's one-hot (last): a linear model on it has
    shared weights plus a correction and a word prior per state. It nests the model on ``x`` alone; the L2 penalty
    pulls the per-state corrections towards the shared weights (no state's model learns from its words alone), and
    the one-hot columns are left unpenalised like a bias (:func:`fit_softmax`'s ``unpenalized``)."""
    x = np.asarray(x, dtype=np.float64)
    states = np.asarray(states, dtype=np.int64)
    if states.shape != (len(x),) or states.min(initial=0) < 0 or states.max(initial=0) >= n_states:
        raise ValueError(f"states: expected {len(x)} values in [0, {n_states}), got shape {states.shape} and range "
                         f"[{states.min(initial=0)}, {states.max(initial=0)}]")
    blocks = np.zeros((len(x), n_states, x.shape[1]))
    rows = np.arange(len(x))
    blocks[rows, states] = x
    return np.concatenate([x, blocks.reshape(len(x), -1), np.eye(n_states)[states]], axis=1)


def topk_accuracy(logp: np.ndarray, labels: np.ndarray, k: int) -> float:
    """Share of rows whose label is among the ``k`` highest scores of ``logp [N, V]`` (torchmetrics' top-k
    accuracy, micro-averaged: the same rule as the decoder's retrieval metric)."""
    from torchmetrics.functional.classification import multiclass_accuracy

    scores = torch.as_tensor(np.asarray(logp, dtype=np.float64))
    return float(multiclass_accuracy(scores, torch.as_tensor(np.asarray(labels, dtype=np.int64)),
                                     num_classes=scores.shape[1], top_k=min(k, scores.shape[1]), average="micro"))


def word_state_probe(train: Tuple[np.ndarray, np.ndarray, np.ndarray], test: Tuple[np.ndarray, np.ndarray, np.ndarray],
                     n_words: int, n_states: int, k: int = 10, l2: float = 1e-2) -> WordStateProbe:
    """Fit two multinomial logistic regressions (:func:`fit_softmax`, standardised features) on the training words
    and score top-``k`` on the held-out ones: on the window's features alone, and on :func:`state_design` of them
    (the same features, one model per true state).

    Args:
        train, test: ``(x [N, D] float, words [N] int in [0, n_words), states [N] int in [0, n_states))``: each
            word's window features (e.g. the preprocessed signal pooled over parts of the window), its label and
            the latent state at its onset.
    """
    (xtr, ytr, str_), (xte, yte, ste) = train, test
    onehot = np.eye(n_words)[np.asarray(ytr, dtype=np.int64)]
    prior = marginal_log_proba(onehot)
    xtr, xte = _standardise(np.asarray(xtr, np.float64), np.asarray(xte, np.float64))
    scores = {}
    for name, (a, b) in {"window": (xtr, xte),
                         "window_state": (state_design(xtr, str_, n_states), state_design(xte, ste, n_states))}.items():
        weight, bias = fit_softmax(a, onehot, l2, init_bias=prior, unpenalized=n_states if name != "window" else 0)
        scores[name] = topk_accuracy(log_proba(b, weight, bias), yte, k)
    return WordStateProbe(window=scores["window"], window_state=scores["window_state"], k=k,
                          chance=min(1.0, k / n_words), train_words=len(ytr), test_words=len(yte), states=n_states,
                          l2=l2)
