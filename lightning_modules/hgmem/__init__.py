"""HGMem: a hypergraph working memory for multi-step RAG (index, memory, loop, baselines, evaluation module)."""
