"""A picture of an HGMem memory: the hypergraph as its incidence graph (entities as circles, memory points as
numbered squares joined to their entities), coloured by where each vertex came from (graph, temporary, missing)."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any, Dict

from litctx_common.io import atomic_path

__all__ = ["draw_memory"]

COLOURS = {"graph": "#4C72B0", "temporary": "#DD8452", "missing": "#C44E52"}


def draw_memory(memory: Dict[str, Any], path: Any, title: str = "") -> Path:
    """Draw ``memory`` (:meth:`~lightning_modules.hgmem.memory.HypergraphMemory.to_json`) to ``path`` (PNG, written
    atomically); an empty memory draws a note saying so."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    import networkx as nx

    points = memory.get("points", [])
    vertices = memory.get("vertices", {})
    g = nx.Graph()
    for i, p in enumerate(points):
        g.add_node(("p", i))
        for e in p["entities"]:
            g.add_node(("e", e))
            g.add_edge(("p", i), ("e", e))
    fig, ax = plt.subplots(figsize=(9, 6.5))
    if not points:
        ax.text(0.5, 0.5, "empty memory (no point was written)", ha="center", va="center")
    else:
        pos = nx.spring_layout(g, seed=0, k=1.2 / max(1, len(g) ** 0.5))
        ents = [n for n in g if n[0] == "e"]
        pts = [n for n in g if n[0] == "p"]
        nx.draw_networkx_edges(g, pos, ax=ax, alpha=0.5)
        nx.draw_networkx_nodes(g, pos, nodelist=ents, ax=ax, node_size=500, node_shape="o",
                               node_color=[COLOURS.get(vertices.get(n[1], {}).get("source", "graph"), "#888")
                                           for n in ents])
        nx.draw_networkx_nodes(g, pos, nodelist=pts, ax=ax, node_size=650, node_shape="s", node_color="#55A868")
        nx.draw_networkx_labels(g, pos, {n: n[1] for n in ents}, ax=ax, font_size=8)
        nx.draw_networkx_labels(g, pos, {n: str(n[1] + 1) for n in pts}, ax=ax, font_size=9, font_color="white")
        legend = "\n".join(textwrap.shorten(f"{i + 1}. {p['description']}", 110) for i, p in enumerate(points[:10]))
        ax.text(0.0, -0.02, legend, transform=ax.transAxes, va="top", fontsize=7, family="monospace")
    ax.set_title(textwrap.shorten(title, 100) if title else "HGMem memory", fontsize=10)
    ax.axis("off")
    target = Path(path)
    with atomic_path(target) as tmp:
        fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return target
