"""The shared LLM base: what every LLM method builds on. One subpackage per concern (imports no method package):

* :mod:`~lightning_modules.llm.model` - loading (SmolLM2, Gemma-3, HF folders, tiny-*), surgery, the ``litctx``
  attention function, the causal-LM LightningModule.
* :mod:`~lightning_modules.llm.runtime` - the cached LM, the generic runner stack, the slot buffer, the KV segment
  store, cache surgery.
* :mod:`~lightning_modules.llm.kv_policy` - the KV-policy protocol, its layer runner and session, the callback.
* :mod:`~lightning_modules.llm.sparse_read` - read sets shared by a call's queries, read methods (dense, Quest).
* :mod:`~lightning_modules.llm.decoding` - the step-wise decoder, sampling, speculative decoding, drafts, drivers,
  stop tokens.
* :mod:`~lightning_modules.llm.serving` - chat backends, the recorded call log, the OpenAI-compatible server,
  structured output.
* :mod:`~lightning_modules.llm.eval` - the records base of evaluations, the long-context suite, metrics, reports,
  judges.
"""
