"""Speculative decoding as a method package: the callback (any verifier by name), the verifier table and draft
distillation. The draft-and-verify engine itself is shared and lives in ``lightning_modules.llm``."""
