"""Retrieval shared by the RAG methods (ProphetKV, Guidance, HGMem, C-DIC): sentence splitting and chunking
(:mod:`.text`), sentence embedders (:mod:`.embedders`), dense and BM25 indexes (:mod:`.index`), and a document
store with its retriever (:mod:`.store`)."""
