"""OpenAI-compatible HTTP server (`pagedllm serve`): server.py (app), serving.py, protocol.py, metrics.py."""
