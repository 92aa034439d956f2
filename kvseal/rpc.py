"""One decorator for every gRPC servicer method (the engine's and the MetaServer's): the method's KvsealErrors answer
their status (kvseal.errors.translate), any other exception is a bug, logged and answered INTERNAL naming the
method, and every call is timed into the servicer's `observe_rpc(method, status, seconds)`."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import grpc

from kvseal.errors import KvsealError, translate

log = logging.getLogger("kvseal.rpc")
F = TypeVar("F", bound=Callable[..., Any])


class Servicer(Protocol):
    rpc_where: str  # who answers, in messages: "the engine", "the MetaServer"

    def observe_rpc(self, method: str, status: str, seconds: float) -> None: ...


def handler(method: F) -> F:
    name = method.__name__

    @functools.wraps(method)
    def wrapper(self: Servicer, request: Any, context: grpc.ServicerContext) -> Any:
        start = time.perf_counter()
        code = "OK"
        try:
            return method(self, request, context)
        except Exception as e:
            if not isinstance(e, KvsealError):  # a bug, not bad input: keep serving, say what broke
                log.exception("%s failed", name)
            status, message = translate(e, f"{name} failed inside {self.rpc_where}")
            code = status.name
            context.abort(grpc.StatusCode[status.name], message)
        finally:
            self.observe_rpc(name, code, time.perf_counter() - start)

    return wrapper  # type: ignore[return-value]
