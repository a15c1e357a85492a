"""Sentences and chunks for retrieval: :mod:`litctx_common.sentences` (the data side builds samples with them too,
and ``datamodules`` and ``lightning_modules`` may not import each other), re-exported here."""

from litctx_common.sentences import ABBREVIATIONS, SPLITTERS, Chunk, Sentence, chunk_document, split_sentences

__all__ = ["Sentence", "Chunk", "split_sentences", "chunk_document", "ABBREVIATIONS", "SPLITTERS"]
