"""Retrieval-augmented evaluation: prompts as reusable token pieces (:mod:`.prompts`) and the evaluation module
that runs a KV-reuse prefill (ProphetKV and baselines) and citation-guided decoding (Guidance) on RAG data."""
