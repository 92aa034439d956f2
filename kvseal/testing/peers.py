"""Another node, in process: a fake kvseal.engine.tiers.PeerSource holding pages by (final namespace, hash), so the
engine's peer path (lookup, fetch into refill pages, seal, write-through, misses) runs without a MetaServer or a
second engine. It can be told to give fewer pages than it offered, to fail, or to leave the rest of a fetch
"unsettled" (a transfer that timed out and may still write) until `settle()`."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from kvseal.core.layout import Layout


@dataclass
class FakePeerSource:
    address: str = "peer-a:7000"
    pages: dict[tuple[str, bytes], bytes] = field(default_factory=dict)
    give: int | None = None  # at most this many pages per fetch (None: all it holds)
    fail: Exception | None = None  # raised by the next fetches
    unsettled: bool = False  # a fetch that gives less leaves the rest unsettled until settle()
    lookups: list[tuple[str, int]] = field(default_factory=list)  # (namespace_final, hashes asked)
    fetches: list[tuple[str, int]] = field(default_factory=list)  # (namespace_final, hashes fetched)
    _settled: threading.Event = field(default_factory=threading.Event)

    def hold(self, namespace_final: str, hashes: list[bytes], pages: list[bytes]) -> None:
        for h, page in zip(hashes, pages, strict=True):
            self.pages[(namespace_final, h)] = page

    def settle(self) -> None:
        """The unsettled transfers end: wait_settled returns True."""
        self._settled.set()

    def lookup(self, namespace_final: str, hashes: list[bytes]) -> tuple[str, int] | None:
        self.lookups.append((namespace_final, len(hashes)))
        held = 0
        while held < len(hashes) and (namespace_final, hashes[held]) in self.pages:
            held += 1
        return (self.address, held) if held else None

    def fetch(
        self,
        address: str,
        namespace_final: str,
        layout: Layout,
        hashes: list[bytes],
        offsets: list[int],
        destinations: list[memoryview],
    ) -> tuple[int, bool]:
        assert address == self.address, address
        self.fetches.append((namespace_final, len(hashes)))
        if self.fail is not None:
            raise self.fail
        got = 0
        limit = len(hashes) if self.give is None else min(self.give, len(hashes))
        while got < limit and (page := self.pages.get((namespace_final, hashes[got]))) is not None:
            assert len(page) == layout.page_bytes == len(destinations[got])
            destinations[got][:] = page
            got += 1
        return got, self.unsettled and got < len(hashes)

    def wait_settled(self, timeout_s: float) -> bool:
        return self._settled.wait(timeout_s)
