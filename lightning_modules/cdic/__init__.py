"""C-DIC: revisable per-thread compression states for long dialogues, trained with truncated backpropagation
through time over turns (``../shared/research/llm_memory_methods.md`` section 2; ``docs/cdic.md``)."""
