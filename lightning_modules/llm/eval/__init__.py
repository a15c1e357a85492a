"""Evaluation: the records base of every evaluation module, the long-context suite and its callback, metrics,
reports and judges."""
