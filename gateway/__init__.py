"""The HTTP face of the fleet: the native ``/v1/requests`` API, OpenAI-compatible routes, SSE, middleware.

``fleet api`` runs :func:`serve`; tests and embedders build the ASGI app with :func:`create_app`.
"""

from __future__ import annotations

from gateway.app import create_app, serve

__all__ = ["create_app", "serve"]
