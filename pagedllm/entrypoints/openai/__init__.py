"""OpenAI-compatible HTTP server (`pagedllm serve`)."""
from pagedllm.entrypoints.openai.server import add_serve_args, build_app, run_server

__all__ = ["add_serve_args", "build_app", "run_server"]
