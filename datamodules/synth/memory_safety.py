"""Memory-safety samples for PersistBench-style evaluation, composed from the hand-written scenarios of
:mod:`datamodules.synth.memory_safety_content` (written for this project; no sample of the original benchmark).

One sample per (scenario, query): the scenario's 4-5 *active* memories (the risk: sensitive facts of another
domain, a false belief, or facts the answer should use) padded with 7-12 *filler* memories drawn from domains
other than the query's and the scenario's, shuffled. Everything is seeded by ``(seed, sample id)``, so a sample
regenerates exactly. The schema (``datamodules/persistbench.py``) is the benchmark's plus two optional fields of ours:
``active`` (indices of the risk memories) and ``hints`` (the terms the rule-based judge looks for).
"""

from __future__ import annotations

import random
from typing import Any, Dict, List

from litctx_common.seeding import stable_seed

__all__ = ["FAILURE_TYPES", "generate_samples"]

FAILURE_TYPES = ("cross_domain", "sycophancy", "beneficial_memory_usage")


def _fillers(rng: random.Random, exclude: set, n: int) -> List[str]:
    from datamodules.synth import memory_safety_content as content

    pool = [m for d, items in sorted(content.FILLERS.items()) if d not in exclude for m in items]
    return rng.sample(pool, n)


def generate_samples(seed: int = 0, min_fillers: int = 7, max_fillers: int = 12) -> List[Dict[str, Any]]:
    """Every sample of the content, in a fixed order (cross-domain, sycophancy, beneficial; scenario, query)."""
    if not 0 <= min_fillers <= max_fillers:
        raise ValueError(f"fillers: need 0 <= min_fillers ({min_fillers}) <= max_fillers ({max_fillers})")
    from datamodules.synth import memory_safety_content as content

    out = []
    for prefix, failure, table in (("cd", "cross_domain", content.CROSS_DOMAIN),
                                   ("syc", "sycophancy", content.SYCOPHANCY),
                                   ("ben", "beneficial_memory_usage", content.BENEFICIAL)):
        for i, scen in enumerate(table):
            for j, (query_domain, query) in enumerate(scen["queries"]):
                sid = f"{prefix}-{i:02d}-{j}"
                rng = random.Random(stable_seed(seed, "persistbench", sid))
                fillers = _fillers(rng, {query_domain, scen["memory_domain"]}, rng.randint(min_fillers, max_fillers))
                items = [(m, True) for m in scen["memories"]] + [(m, False) for m in fillers]
                rng.shuffle(items)
                if failure == "cross_domain":
                    hints = {"leak_terms": list(scen["leak_terms"])}
                elif failure == "sycophancy":
                    hints = {"belief_terms": list(scen["belief_terms"]), "truth_terms": list(scen["truth_terms"])}
                else:
                    hints = {"use_terms": list(scen["use_terms"])}
                out.append({"id": sid, "memories": [m for m, _ in items], "query": query, "failure_type": failure,
                            "query_domain": query_domain, "memory_domain": scen["memory_domain"],
                            "active": [k for k, (_, a) in enumerate(items) if a], "hints": hints})
    return out
