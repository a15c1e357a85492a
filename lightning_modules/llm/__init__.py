"""Hugging Face causal LMs for the LLM methods: loading (:mod:`.loading`), the ``litctx`` attention function
(:mod:`.attention`), the KV-cache policy protocol (:mod:`.policy`) and its installer (:mod:`.session`),
greedy decoding with a cache (:mod:`.generation`) and the LightningModules (:mod:`.module`).

Submodules import transformers; importing this package does not.
"""
