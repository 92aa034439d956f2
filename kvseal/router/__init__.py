"""`kvseal router`: an OpenAI-compatible prefill/decode router in front of vLLM instances. Each request runs its
prompt on a prefill instance (one token, KV kept), then on a decode instance that loads that KV and answers the
client; kvseal layouts are checked on the way, so an incompatible pair is refused with the reason instead of
silently recomputing. config: the command line's checks; pool: instances and policies; legs: what each leg sends
and reads; server: the aiohttp service."""

from __future__ import annotations

import asyncio

from kvseal.router.config import RouterConfig, check_config

__all__ = ["RouterConfig", "check_config", "run"]


def run(cfg: RouterConfig) -> int:
    """Serves until SIGTERM or SIGINT (0), or 1 when it cannot listen."""
    from kvseal.router.server import serve  # aiohttp is imported only once the command line is good

    return asyncio.run(serve(cfg))
