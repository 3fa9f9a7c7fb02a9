"""guidellm (vLLM's benchmark client) run unchanged against a real gateway, in its own virtual environment."""
