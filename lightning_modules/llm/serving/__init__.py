"""Serving: chat backends (local, OpenAI-compatible HTTP, scripted), the recorded call log, the OpenAI-compatible
server and structured output."""
