"""What the routing tests (test_routing.py, test_twins_more.py) build requests from."""

from __future__ import annotations


def request_headers(**h):
    """Request headers as the proxy's router gets them (aiohttp's CIMultiDict); ``x_task`` is ``X-Task``."""
    from multidict import CIMultiDict

    return CIMultiDict({k.replace("_", "-"): v for k, v in h.items()})
