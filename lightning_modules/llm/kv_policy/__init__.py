"""The KV-policy protocol (scorer, selector, action, compensator, schedule), its layer runner and session, and the
``kv_policy`` callback."""
