"""What `kvseal router` runs with, and the checks of it that need no network: kept free of aiohttp and grpc so
that a wrong command line is refused at once."""

from __future__ import annotations

import dataclasses
import urllib.parse
from dataclasses import dataclass

from kvseal.auth import is_loopback
from kvseal.errors import ConfigError

POLICIES = ("round_robin", "least_inflight")
DEFAULT_MAX_BODY_BYTES = 4 << 20  # a long prompt, or a few images, fit
# What one request in flight costs in file descriptors: the client's connection, one to its prefill and one to its
# decode instance (kept alive for the next requests), and headroom for clients' idle keep-alive connections and
# the ones being refused; plus a reserve for the process itself.
FDS_PER_REQUEST = 4
FD_RESERVE = 64
MAX_DEFAULT_REQUESTS = 8192


def default_max_requests(open_files: int) -> int:
    """--max-requests when not given: what `open_files` descriptors (the soft RLIMIT_NOFILE) carry."""
    return max(1, min(MAX_DEFAULT_REQUESTS, (open_files - FD_RESERVE) // FDS_PER_REQUEST))


@dataclass(frozen=True, slots=True)
class RouterConfig:
    prefill: tuple[str, ...]  # base URLs (scheme://host:port[/prefix], no trailing slash) of the prefill instances
    decode: tuple[str, ...]
    listen: str = "127.0.0.1:8000"
    policy: str = "round_robin"
    metaserver: str = ""  # HOST:PORT of a kvseal metaserver that picks decode instances by prefix ('' = none)
    token: str | None = None  # the MetaServer's
    timeout_s: float = 300.0
    allow_remote: bool = False
    max_requests: int = 0  # requests served at once, beyond which a client gets 503 (0: from the open-file limit)
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # a larger request body gets 413


def instance_url(flag: str, text: str) -> str:
    """`text` as a base URL the router appends /v1/... to; raises ConfigError naming `flag` when it is not one."""
    url = urllib.parse.urlsplit(text.strip())
    try:
        port = url.port
    except ValueError:
        port = None
    if url.scheme not in ("http", "https") or not url.hostname or port is None or url.query or url.fragment:
        raise ConfigError(
            f"argument {flag}: {text!r} is not an instance's URL: pass http://HOST:PORT (the address vLLM serves "
            "its OpenAI API on)"
        )
    return f"{url.scheme}://{url.netloc}{url.path.rstrip('/')}"


def check_config(cfg: RouterConfig) -> RouterConfig:
    """The config with every URL normalised; raises ConfigError naming the flag and the fix when `cfg` cannot run."""
    lists = {}
    for flag, urls in (("--prefill", cfg.prefill), ("--decode", cfg.decode)):
        if not urls:
            raise ConfigError(f"argument {flag}: no instance given: pass {flag} http://HOST:PORT at least once")
        normal = tuple(instance_url(flag, u) for u in urls)
        if len(set(normal)) != len(normal):
            raise ConfigError(f"argument {flag}: an instance is given twice: pass each instance once")
        lists[flag] = normal
    if cfg.max_requests < 0:
        raise ConfigError(
            f"argument --max-requests: at least 1 (or 0: from the open-file limit), got {cfg.max_requests}"
        )
    if cfg.max_body_bytes <= 0:
        raise ConfigError(f"argument --max-body-size: more than 0 bytes, got {cfg.max_body_bytes}")
    if cfg.policy not in POLICIES:
        raise ConfigError(f"argument --policy: one of {', '.join(POLICIES)}, got {cfg.policy!r}")
    if not is_loopback(cfg.listen) and not cfg.allow_remote:
        # the router forwards to the instances whatever it is sent, with the clients' credentials: local by default
        raise ConfigError(
            f"argument --listen: {cfg.listen!r} is not a loopback address, and the router listens on loopback only: "
            f"pass 127.0.0.1:{cfg.listen.rsplit(':', 1)[1]} (for other machines to reach it, add --allow-remote)"
        )
    return dataclasses.replace(cfg, prefill=lists["--prefill"], decode=lists["--decode"])
