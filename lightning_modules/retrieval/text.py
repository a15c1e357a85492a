"""Sentences and chunks for retrieval: :mod:`datamodules.sentences` (the data side builds samples with them too;
``datamodules`` may not import ``lightning_modules``), re-exported here."""

from datamodules.sentences import ABBREVIATIONS, SPLITTERS, Chunk, Sentence, chunk_document, split_sentences

__all__ = ["Sentence", "Chunk", "split_sentences", "chunk_document", "ABBREVIATIONS", "SPLITTERS"]
