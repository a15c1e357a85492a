"""The sparse-read kit: read sets shared by a call's queries, the compact gather and fused kernel, exact KV bytes and
ARR; read methods for decode and verification calls (dense, Quest)."""
