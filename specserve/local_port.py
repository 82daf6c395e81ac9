"""A local TCP port nothing listens on (the OS picks it), for a rendezvous or a child server."""

from __future__ import annotations

import socket


def free_local_port() -> int:
    """A port free on 127.0.0.1 when this returns (another process could still take it before use)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
