"""Synthetic structured attention heads with RoPE: the shared test bed of every block estimator
(``research/attention_kernels.md`` section 8.9).

Each head is built from un-rotated vectors and then rotated like a real RoPE model, so the structure lives in
the same frequency bands as in trained models:

* ``slash`` - ``q_t = R_t u``, ``k_t = R_{t+o} u``: ``q_i . k_j`` peaks on the diagonal ``j = i - o``; the
  energy of ``u`` sits in the high-frequency pairs, where mean pooling cancels it (Prism's blind spot).
  One to three offsets per head, plus what trained heads carry on the slow pairs: an attention sink, and
  ``content`` - a query and key direction per segment of ``segment`` tokens (topical persistence), whose
  logits vary from block to block. Both survive mean pooling, while the slash itself is attenuated, so a
  full-dimension pooled estimate follows the content and misses the slash (Prism's argument).
* ``attenuated_slash`` - the head Prism's argument is about: a positional pedestal on the slow pairs
  (``q_t = R_t c``, ``k_t = R_t c``: logits fall smoothly with distance and survive pooling) plus one slash whose
  vector lives only in the pairs mean pooling over ``block`` tokens attenuates without erasing
  (``attenuated_zone[0] < lambda_j(block) < attenuated_zone[1]``). In the full-dimension pooled logit the
  pedestal outweighs the attenuated slash; in a band without the slow pairs the slash is what is left.
* ``local`` - slashes at every offset ``0 .. window``: a band along the causal diagonal.
* ``sink`` - the first ``n_sink`` keys carry a large low-frequency component that every query shares.
* ``needle`` - the queries of one range share a low-frequency component with one distant run of keys.
* ``diffuse`` - i.i.d. Gaussian queries and keys: attention close to uniform.

Every head adds Gaussian noise to ``q`` and ``k``; values are i.i.d. Gaussian.
"""

from __future__ import annotations

import math
from typing import Dict, List, Sequence, Tuple

import torch

from lightning_modules.layers.rope import apply_rope, pooled_attenuation, rope_frequencies

__all__ = ["HEAD_KINDS", "structured_head", "structured_heads", "offset_blocks"]

HEAD_KINDS = ("slash", "attenuated_slash", "local", "sink", "needle", "diffuse")


def _pairs_vector(d: int, pairs: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """A random unit vector whose energy lies in the RoPE pairs where ``pairs [d/2]`` is nonzero."""
    mask = torch.cat([pairs, pairs]).to(torch.float64)
    u = torch.randn(d, generator=gen, dtype=torch.float64) * mask
    return u / u.norm()


def _band_vector(d: int, lo: float, hi: float, gen: torch.Generator) -> torch.Tensor:
    """A unit vector whose energy lies in the RoPE pairs ``[lo, hi)`` (fractions of ``d/2``; pair 0 = fastest)."""
    half = d // 2
    pairs = torch.zeros(half, dtype=torch.float64)
    pairs[int(lo * half):max(int(lo * half) + 1, int(hi * half))] = 1.0
    return _pairs_vector(d, pairs, gen)


def _rotated(vectors: torch.Tensor, positions: torch.Tensor, base: float) -> torch.Tensor:
    return apply_rope(vectors, positions, base)


def structured_head(kind: str, n: int = 4096, d: int = 64, *, base: float = 10000.0, seed: int = 0,
                    sharpness: float = 12.0, noise: float = 0.3, content: float = 3.0, segment: int = 128,
                    slash_band: float = 0.5, block: int = 64, pedestal: float = 8.0,
                    attenuated_zone: Tuple[float, float] = (0.2, 0.9)
                    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, Dict[str, object]]:
    """One head: ``q, k, v [N, d]`` (float32, RoPE applied) and a dict describing the planted structure.

    Args:
        kind: one of :data:`HEAD_KINDS`.
        n, d: length and head dimension (even).
        base: RoPE base.
        seed: the head's seed.
        sharpness: peak logit (after the ``1/sqrt(d)`` scale) of the planted structure.
        noise: standard deviation of the Gaussian noise added to ``q`` and ``k`` (unit-norm structure vectors
            are scaled so that ``q . k / sqrt(d)`` reaches ``sharpness``).
        content, segment: ``slash`` heads only: the typical size (logit units) of the per-segment content
            logits on the slow pairs, and the segment length (0 disables content).
        slash_band: ``slash`` / ``local`` heads: the share of the pairs, fastest first, that carries the slash.
        block, pedestal, attenuated_zone: ``attenuated_slash`` heads only: the pooling block whose attenuation
            ``lambda_j(block)`` picks the slash's pairs (those inside ``attenuated_zone``; the pair closest to 0.5
            when none is), and the peak logit of the positional pedestal (on the slower half of the pairs).
    """
    if kind not in HEAD_KINDS:
        raise ValueError(f"kind={kind!r}: valid head kinds are {', '.join(HEAD_KINDS)}")
    if n < 64 or d < 8 or d % 2:
        raise ValueError(f"need n >= 64 and an even d >= 8, got n={n}, d={d}")
    gen = torch.Generator().manual_seed(seed)
    t = torch.arange(n, dtype=torch.float64)
    amp = math.sqrt(sharpness * math.sqrt(d))  # |q| |k| / sqrt(d) = sharpness for unit directions
    q0 = torch.zeros(n, d, dtype=torch.float64)
    k = torch.zeros(n, d, dtype=torch.float64)
    info: Dict[str, object] = {"kind": kind}
    if kind in ("slash", "local"):
        if kind == "slash":
            count = int(torch.randint(1, 4, (1,), generator=gen))
            offsets = sorted(int(o) for o in torch.randint(8, max(9, n // 4), (count,), generator=gen))
            weights = [1.0] * count
        else:
            window = 48
            offsets = list(range(0, window))
            weights = [math.exp(-o / 16) for o in offsets]
        info["offsets"] = offsets
        if kind == "slash":  # a sink on the slow pairs, shared by every query
            c = _band_vector(d, 0.75, 1.0, gen)
            q0 += amp * c
            k[:4] += _rotated((amp * c).expand(4, d), t[:4], base)
            info["sink"] = list(range(4))
            if content > 0:  # per-segment content directions on the slow pairs
                n_seg = -(-n // segment)
                half = d // 2
                slow = torch.zeros(d, dtype=torch.float64)
                slow[int(0.75 * half):half] = 1.0
                slow[half + int(0.75 * half):] = 1.0
                zq = torch.randn(n_seg, d, generator=gen, dtype=torch.float64) * slow
                zk = torch.randn(n_seg, d, generator=gen, dtype=torch.float64) * slow
                # q . k / sqrt(d) of two such directions has standard deviation ~ content
                a_c = math.sqrt(content * math.sqrt(d) / math.sqrt(float(slow.sum())))
                seg = torch.arange(n) // segment
                q0 = q0 + a_c * zq[seg]
                k += _rotated(a_c * zk[seg], t, base)
        for o, w in zip(offsets, weights):
            u = _band_vector(d, 0.0, slash_band, gen)  # the fast (high-frequency) pairs
            q0 += amp * math.sqrt(w) * u
            k += _rotated(amp * math.sqrt(w) * u.expand(n, d), t + o, base)
        q = _rotated(q0, t, base)
    elif kind == "attenuated_slash":
        half = d // 2
        lam = pooled_attenuation(rope_frequencies(d, base), block)
        zone = (lam > attenuated_zone[0]) & (lam < attenuated_zone[1])
        if not zone.any():
            zone = torch.zeros(half, dtype=torch.bool)
            zone[int((lam - 0.5).abs().argmin())] = True
        slow = torch.arange(half) >= half // 2
        c, u = _pairs_vector(d, slow, gen), _pairs_vector(d, zone, gen)
        a_p = math.sqrt(pedestal * math.sqrt(d))
        offset = int(torch.randint(max(1, n // 8), max(2, n // 2), (1,), generator=gen))
        q = _rotated((a_p * c + amp * u).expand(n, d), t, base)
        k = _rotated((a_p * c).expand(n, d), t, base) + _rotated((amp * u).expand(n, d), t + offset, base)
        info.update(offsets=[offset], pairs=torch.nonzero(zone).flatten().tolist())
    elif kind == "sink":
        n_sink = 4
        c = _band_vector(d, 0.75, 1.0, gen)  # slow pairs: the alignment survives long distances
        q = _rotated((amp * c).expand(n, d), t, base)
        k[:n_sink] = _rotated((amp * c).expand(n_sink, d), t[:n_sink], base)
        info["sink"] = list(range(n_sink))
    elif kind == "needle":
        c = _band_vector(d, 0.75, 1.0, gen)
        start = int(torch.randint(0, n // 2, (1,), generator=gen))
        width = 16
        rows = (3 * n // 4, n)
        q = torch.zeros(n, d, dtype=torch.float64)
        q[rows[0]:] = _rotated((amp * c).expand(n - rows[0], d), t[rows[0]:], base)
        k[start:start + width] = _rotated((amp * c).expand(width, d), t[start:start + width], base)
        info.update(needle=(start, start + width), rows=rows)
    else:
        q = torch.randn(n, d, generator=gen, dtype=torch.float64)
        k = torch.randn(n, d, generator=gen, dtype=torch.float64)
    q = q + noise * torch.randn(n, d, generator=gen, dtype=torch.float64)
    k = k + noise * torch.randn(n, d, generator=gen, dtype=torch.float64)
    v = torch.randn(n, d, generator=gen, dtype=torch.float64)
    return q.float(), k.float(), v.float(), info


def structured_heads(kinds: Sequence[str], n: int = 4096, d: int = 64, *, base: float = 10000.0, seed: int = 0,
                     **kw) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, List[Dict[str, object]]]:
    """Several heads stacked as ``q, k, v [1, H, N, d]`` (one per entry of ``kinds``; head ``h`` uses seed
    ``seed * 1000 + h``) and their descriptions."""
    parts = [structured_head(kind, n, d, base=base, seed=seed * 1000 + h, **kw) for h, kind in enumerate(kinds)]
    q, k, v = (torch.stack([p[i] for p in parts]).unsqueeze(0) for i in range(3))
    return q, k, v, [p[3] for p in parts]


def offset_blocks(n: int, offset: int, block: int) -> torch.Tensor:
    """``[M, M]`` bool (``M = ceil(n / block)``): the (query block, key block) tiles the diagonal ``j = i - offset``
    crosses, i.e. where a slash at that offset puts its attention."""
    if offset < 0 or block < 1:
        raise ValueError(f"need offset >= 0 and block >= 1, got offset={offset}, block={block}")
    m = -(-n // block)
    out = torch.zeros(m, m, dtype=torch.bool)
    i = torch.arange(offset, n)
    out[i // block, (i - offset) // block] = True
    return out
