"""Guidance: citation-enforced decoding by Prefix-Tail guidance (:mod:`.method`), scored with LongBench-Cite's
citation metrics (:mod:`.longbench_cite`)."""
