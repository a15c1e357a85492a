"""Layer-wise linear probes of a PCFG transformer for the inside algorithm's constituent labels.

For a string ``x [n]`` (``n = 2**K``) the span ``j`` of level ``k`` covers tokens ``[j 2^k, (j+1) 2^k)``; its
**constituent label** is the symbol with the largest inside probability, ``argmax_A beta_k(j, A)`` (level 0: the
token itself). The causal model reads ``[BOS, x_0, ..., x_{n-2}]``, so the first hidden state that has seen the
whole span is at input position ``e + 1`` with ``e = (j+1) 2^k - 1`` its last token; spans that end at the last
token are never seen and are skipped.

:func:`layer_states` returns the residual stream after the embedding and after every block;
:func:`probe_dataset` pairs each (layer, level) state with its label; :func:`probe_accuracy` fits a multinomial
logistic regression per (layer, level) on one set of strings and scores it on another, next to the majority-
class baseline. The expected "local to global" profile: low levels decodable early, high levels only later.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import numpy as np
import torch

__all__ = ["layer_states", "span_labels", "probe_dataset", "probe_accuracy"]


@torch.no_grad()
def layer_states(module, x: torch.Tensor) -> List[torch.Tensor]:
    """``[h_0, h_1, ..., h_L]``, each ``[N, n, d]``: the embedding, then the output of each block (before the
    final norm) of a :class:`~lightning_modules.pcfg.module.PCFGModule` on strings ``x [N, n]``."""
    bos = torch.full_like(x[:, :1], module.cfg.vocab)
    h = module.embed(torch.cat([bos, x[:, :-1]], dim=1))
    out = [h]
    for block in module.body.blocks:
        h = block(h)
        out.append(h)
    return out


def span_labels(grammar, x: torch.Tensor) -> List[torch.Tensor]:
    """``[labels_0, ..., labels_{K-1}]`` with ``labels_k [N, 2**(K-k)]``: the argmax-inside symbol of every
    level-``k`` span (level 0: the tokens)."""
    betas = grammar.inside(x)
    return [x.long()] + [b.argmax(-1) for b in betas[1:grammar.cfg.depth]]


def probe_dataset(states: List[torch.Tensor], labels: List[torch.Tensor]) -> Dict[Tuple[int, int], tuple]:
    """``{(layer, level): (features [M, d], labels [M])}`` over every span that a causal state has fully seen."""
    n = states[0].shape[1]
    out = {}
    for level, lab in enumerate(labels):
        width = 2 ** level
        spans = [j for j in range(lab.shape[1]) if (j + 1) * width - 1 < n - 1]
        pos = torch.tensor([(j + 1) * width for j in spans])  # input position e + 1
        y = lab[:, spans].reshape(-1)
        for layer, h in enumerate(states):
            out[(layer, level)] = (h[:, pos].reshape(-1, h.shape[-1]), y)
    return out


def probe_accuracy(train: Dict[Tuple[int, int], tuple], test: Dict[Tuple[int, int], tuple], c: float = 1.0,
                   max_iter: int = 1000) -> Dict[Tuple[int, int], Dict[str, float]]:
    """Fit ``LogisticRegression(C=c)`` (standardised features) per key on ``train``, score on ``test``;
    returns ``{key: {"acc": ..., "majority": ...}}``."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.preprocessing import StandardScaler

    result = {}
    for key, (xtr, ytr) in train.items():
        xte, yte = test[key]
        xtr_np, ytr_np = xtr.float().numpy(), ytr.numpy()
        xte_np, yte_np = xte.float().numpy(), yte.numpy()
        values, counts = np.unique(ytr_np, return_counts=True)
        majority = float((yte_np == values[counts.argmax()]).mean())
        if len(values) < 2:
            result[key] = {"acc": majority, "majority": majority}
            continue
        scaler = StandardScaler().fit(xtr_np)
        clf = LogisticRegression(C=c, max_iter=max_iter).fit(scaler.transform(xtr_np), ytr_np)
        acc = float((clf.predict(scaler.transform(xte_np)) == yte_np).mean())
        result[key] = {"acc": acc, "majority": majority}
    return result
