"""`lorafleet-proxy`: the fleet port (no credentials) and, with PROXY_API_KEY, the public port, in one process.

Both ports serve the same app from one event loop (so they share router, fleet and ledger); the
public one wraps it in bearer-key auth. Each port has its own bind address (PROXY_FLEET_HOST,
PROXY_PUBLIC_HOST): the keyless fleet port listens only where the trainer's network reaches it.
Exits 2 with a message naming the variable on bad config.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import gc
import logging
import signal
import sys
from collections.abc import Iterator

import uvicorn
import uvloop
from lorafleet.logs import configure
from lorafleet.settings import ConfigError, ProxySettings, load_settings

from .app import BearerAuth, create_app, require_upstreams
from .server_protocol import CoalescingHttpToolsProtocol

log = logging.getLogger("lorafleet.proxy")

# Each request allocates a few hundred container objects, nearly all freed by reference counting; the
# default gen-0 threshold (700) runs the cycle collector several times per request, and each pass gets
# dearer with the requests in flight. Measured on the hot path: ~15% less CPU per request at 128 in flight.
GC_GEN0_THRESHOLD = 20_000
# glibc serves a large allocation from its own mapping only while it is above a threshold that rises to
# the largest block ever freed; the routing table's dicts (several MB, rebuilt at every generation turn)
# then come from the heap, which fragments and does not shrink: RSS crept ~1.5 MB per million requests
# and stood ~10 MB higher. A fixed threshold keeps every big table in a mapping that is returned when freed.
M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)
MMAP_THRESHOLD_BYTES = 128 * 1024  # glibc's own starting value, no longer raised


def fix_mmap_threshold() -> bool:
    """Pin glibc's mmap threshold; False where the C library cannot (no mallopt, or musl's stub that ignores it)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))


class _Server(uvicorn.Server):
    """A uvicorn server that leaves signal handling to `serve` (two servers share one loop)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def serve(settings: ProxySettings) -> None:
    app = create_app(settings)
    gc.collect()
    gc.freeze()  # everything built at startup (modules, app, routes) is never traversed by the collector again
    # No X-Forwarded-* rewriting (nothing reads the client address): one middleware less on every request.
    # The protocol joins a response's head and body into one write (server_protocol.py says why).
    common = {"log_config": None, "access_log": False, "timeout_keep_alive": 75, "proxy_headers": False,
              "http": CoalescingHttpToolsProtocol}
    servers = [_Server(uvicorn.Config(app, host=settings.proxy_fleet_host, port=settings.proxy_port, lifespan="on",
                                      **common))]  # type: ignore[arg-type]
    if settings.proxy_api_key:
        public = BearerAuth(app, settings.proxy_api_key)
        servers.append(_Server(uvicorn.Config(public, host=settings.proxy_public_host, port=settings.proxy_public_port,
                                              lifespan="off", **common)))  # type: ignore[arg-type]
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, lambda: [setattr(server, "should_exit", True) for server in servers])
    public = f"{settings.proxy_public_host}:{settings.proxy_public_port}" if settings.proxy_api_key else "off"
    log.info("proxy listening fleet=%s:%d public=%s", settings.proxy_fleet_host, settings.proxy_port, public)
    await asyncio.gather(*(server.serve() for server in servers))


def main() -> None:
    try:
        settings = load_settings(ProxySettings)
        require_upstreams(settings)
    except ConfigError as exc:
        print(f"lorafleet-proxy: {exc}", file=sys.stderr)
        sys.exit(2)
    # The shared logfmt lines of every lorafleet service; httpx's per-request lines (health checks every few
    # seconds) stay off unless they are warnings.
    configure("proxy", settings.log_level, loggers=("uvicorn",))
    logging.getLogger("httpx").setLevel(logging.WARNING)
    gc.set_threshold(GC_GEN0_THRESHOLD, 10, 10)
    if not fix_mmap_threshold():
        log.warning("could not pin the C library's mmap threshold (not glibc?): RSS may creep under load")
    # uvloop: asyncio.run would otherwise use the default loop (uvicorn only picks uvloop when it owns the loop).
    uvloop.run(serve(settings))


if __name__ == "__main__":
    main()
