"""Dustin: draft-augmented sparse verification for long-context speculative decoding (arXiv 2606.24957).

``selection`` (the shared read set from the history and lookahead signals), ``signals`` (recording both signals
during decoding), ``method`` (the typed config, the read method and the decoding hook), ``calibration`` (the
offline choice of heads, layer and mixing count as a ``predict`` run).
"""
