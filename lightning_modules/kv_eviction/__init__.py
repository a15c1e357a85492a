"""KV-cache eviction on the policy protocol of :mod:`lightning_modules.llm`: StreamingLLM, H2O, SnapKV, TOVA,
AdaKV, and OBCache's output-aware scores as drop-in replacements of their attention scores.

* :mod:`~lightning_modules.kv_eviction.scores` - attention and OBCache scores from the kernels' column
  statistics (no N x N matrix).
* :mod:`~lightning_modules.kv_eviction.scorers` - accumulated (H2O) and observation-window (SnapKV, TOVA)
  scorers over any score.
* :mod:`~lightning_modules.kv_eviction.selectors` - AdaKV's head-adaptive selection.
* :mod:`~lightning_modules.kv_eviction.config` - typed method configs that build policies.
* :mod:`~lightning_modules.kv_eviction.callbacks` - each method as a Lightning callback.
"""
