"""IndexMem: a learned KV indexer plus a latent memory of the evicted entries (``../shared/research/kv_methods.md``
section 7)."""
