"""Why litctx's L-CUBE generator is not the Markov tree sketched in the research notes.

The notes (science_methods.md 4.3) propose ``z_child = rho A_side z_parent + sqrt(1 - rho^2) eps`` with widths
``m_k = max(D, ceil(c 2^(beta k)))``, ``A`` with orthonormal rows, and ``(c, rho)`` calibrated so that the
slope of log I_BP(L/2; L) against log L equals beta. This script measures that construction exactly:

1. fixed rho: the brute-force slope over L = 32..512 for a grid of (beta, c, rho);
2. per-level rho_k calibrated through the exact information-form recursion (checked against brute force),
   anchored at a base level: in how many settings is the target reachable at all (rho_k <= 1)?

    python -m bench.lcube_markov_tree
"""

from __future__ import annotations

import math
import os
import sys

import numpy as np
import torch

from bench._report import write_section

F64 = torch.float64  # every tensor is created in float64 explicitly (no global default dtype change)


def widths(K, D, beta, c):
    return [D] + [max(D, math.ceil(c * 2 ** (beta * k) - 1e-9)) for k in range(1, K + 1)]


def mixing(m, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k in range(1, len(m)):
        out[k] = [torch.linalg.qr(torch.randn(m[k], m[k - 1], generator=g, dtype=F64))[0].T.contiguous() for _ in range(2)]
    return out


def covariance(K, D, A, rhos):
    """Dense covariance of the leaves (identity marginals): Cov(x_s, x_t) = G_s G_t^T at their LCA level."""
    L = 2**K
    G = torch.eye(D, dtype=F64).expand(L, D, D).clone()
    S = torch.eye(L * D, dtype=F64)
    for k in range(1, K + 1):
        side = (torch.arange(L) >> (k - 1)) & 1
        G = rhos[k - 1] * torch.einsum("tdm,tmn->tdn", G, torch.stack(A[k])[side])
        half = 2 ** (k - 1)
        Gv = G.reshape(L >> k, 2, half * D, -1)
        B = Gv[:, 0] @ Gv[:, 1].transpose(1, 2)
        for node in range(L >> k):
            a, b = node * 2**k * D, (node * 2**k + half) * D
            S[a:b, b:b + half * D] = B[node]
            S[b:b + half * D, a:b] = B[node].T
    return S


def brute_mi(S, n):
    ld = lambda m: torch.linalg.slogdet(m)[1].item()  # noqa: E731
    return 0.5 * (ld(S[:n, :n]) + ld(S[n:, n:]) - ld(S))


def level_info(A, message, r2):
    """MI between the halves of a level-k subtree and its information matrix, given the child message."""
    JL, JR = A[0].T @ message(r2) @ A[0], A[1].T @ message(r2) @ A[1]
    eye = torch.eye(JL.shape[0], dtype=F64)
    ld = lambda m: torch.linalg.slogdet(m)[1].item()  # noqa: E731
    return 0.5 * (ld(eye + JL) + ld(eye + JR) - ld(eye + JL + JR)), JL + JR


def calibrate(K, D, beta, c, rho_base, anchor):
    """rho_k = rho_base up to ``anchor``, then solved so that I_k = I_anchor 2^(beta (k - anchor)).
    Returns the number of the first infeasible level, or None."""
    m = widths(K, D, beta, c)
    A = mixing(m)
    infos, J = [], None
    for k in range(1, K + 1):
        if k == 1:
            msg = lambda r2, n=m[0]: torch.eye(n, dtype=F64) * (r2 / (1 - r2))  # noqa: E731  (leaves are observed exactly)
        else:
            msg = lambda r2, Jp=J: r2 * Jp @ torch.linalg.inv(torch.eye(Jp.shape[0], dtype=F64) + (1 - r2) * Jp)  # noqa: E731
        if k <= anchor:
            r2 = rho_base**2
        else:
            target = infos[anchor - 1] * 2 ** (beta * (k - anchor))
            if level_info(A[k], msg, 1 - 1e-12)[0] < target:
                return k
            lo, hi = 0.0, 1 - 1e-12
            for _ in range(50):
                mid = 0.5 * (lo + hi)
                lo, hi = (mid, hi) if level_info(A[k], msg, mid)[0] < target else (lo, mid)
            r2 = 0.5 * (lo + hi)
        info, J = level_info(A[k], msg, r2)
        J = 0.5 * (J + J.T)
        infos.append(info)
    return None


def main() -> int:
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    lengths = [32, 64, 128, 256, 512]
    lines = ["Command: `python -m bench.lcube_markov_tree` (exact linear algebra, no sampling, seed 0 for "
             "the mixing matrices). D = 2.", "", "Fixed rho, brute-force slope of log I_BP(L/2; L) over L = 32..512:",
             "", "| target beta | c | rho | I_BP at L = 32 ... 512 | fitted slope |", "|---|---|---|---|---|"]
    for beta in (0.5, 0.75):
        for c in (1.0, 2.0, 4.0):
            for rho in (0.9, 0.97):
                m = widths(9, 2, beta, c)
                A = mixing(m)
                values = [brute_mi(covariance(K, 2, A, [rho] * K), 2 ** (K - 1) * 2) for K in range(5, 10)]
                slope = float(np.polyfit(np.log(lengths), np.log(values), 1)[0])
                lines.append(f"| {beta} | {c} | {rho} | " + ", ".join(f"{v:.2f}" for v in values) + f" | {slope:.3f} |")
    feasible = total = 0
    by_beta = {}
    for beta in (0.0, 0.25, 0.5, 0.75, 0.9):
        for c in (1, 2, 4):
            for D in (1, 2, 4):
                for rho_base in (0.8, 0.9, 0.95):
                    for anchor in (1, 2, 3):
                        ok = calibrate(11, D, beta, c, rho_base, anchor) is None
                        feasible += ok
                        total += 1
                        f, t = by_beta.get(beta, (0, 0))
                        by_beta[beta] = (f + ok, t + 1)
    lines += ["", f"Per-level rho_k calibrated to I_k = I_anchor 2^(beta (k - anchor)) up to L = 2048 over beta in "
              "{0, 0.25, 0.5, 0.75, 0.9}, c in {1, 2, 4}, D in {1, 2, 4}, base rho in {0.8, 0.9, 0.95}, anchor "
              f"level in {{1, 2, 3}}: feasible (every rho_k <= 1) in {feasible} of {total} settings; by beta: "
              + ", ".join(f"{b}: {f}/{t}" for b, (f, t) in by_beta.items()) + ".",
              "", "Conclusion: with fixed rho the exponent falls short of beta (information fades level by level), and "
              "the calibrated version cannot reach the law in most settings with beta >= 0.5. litctx uses the "
              "orthogonal multi-scale construction of docs/lcube.md, whose I_BP is exactly info_scale L^beta."]
    print(write_section("lcube_markov_tree", "\n".join(lines),
                        "L-CUBE: the Markov-tree reconstruction of the research notes (`bench/lcube_markov_tree.py`)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
