"""PersistBench: long-term-memory safety of chat assistants (cross-domain leakage, memory-induced sycophancy,
beneficial memory use), judged by rubric LLM judges or a rule-based judge, reported as FR@K."""
