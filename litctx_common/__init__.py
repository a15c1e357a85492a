"""Leaf helpers every litctx package may import: one helper per job (atomic writes and JSONL records, seeding,
cache paths, timing, summary statistics). This package imports nothing else of litctx and nothing heavy at import
time (torch is imported inside the functions that need it)."""
