"""The no-op SSD tier: the Tier interface (kvseal.ssd.tier) of an engine with no SSD configured. It holds nothing
and takes nothing, so a caller needs no "is there a tier?" branch: lookups find nothing, nothing is ever written
(and so no write is ever pinned or acknowledged), the statistics are zero and name no device."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvseal.core.layout import Layout
from kvseal.ssd.index import NamespaceKey
from kvseal.ssd.tier import TierStatistics
from kvseal.ssd.writer import WriteItem


class NullTier:
    def prefix(self, key: NamespaceKey, hashes: Sequence[bytes]) -> int:
        return 0

    def holds(self, key: NamespaceKey, hashes: Sequence[bytes]) -> list[bool]:
        return [False] * len(hashes)

    def absent(self, key: NamespaceKey, hashes: Sequence[bytes]) -> list[int]:
        """None: it takes no block, so there is nothing to write (nor to pin for a write)."""
        return []

    def aging(self, key: NamespaceKey, hashes: Sequence[bytes]) -> list[int]:
        return []

    def write(
        self,
        key: NamespaceKey,
        layout: Layout,
        items: list[WriteItem],
        done: Callable[[bool], None],
        *,
        reinsert: bool = False,
    ) -> int:
        """Takes nothing: 0, and `done` is never called (the Tier contract for blocks not taken)."""
        return 0

    def read(
        self,
        key: NamespaceKey,
        layout: Layout,
        hashes: Sequence[bytes],
        destinations: Sequence[memoryview],
        *,
        quarantine: bool = True,
    ) -> list[str]:
        return ["missing"] * len(hashes)

    def namespaces(self) -> dict[NamespaceKey, tuple[int, int, bytes]]:
        return {}

    def purge(self, key: NamespaceKey) -> int:
        return 0

    def statistics(self) -> TierStatistics:
        return TierStatistics(
            records=0,
            bytes=0,
            segments=0,
            writes=0,
            write_bytes=0,
            write_seconds=0.0,
            reads=0,
            read_bytes=0,
            read_seconds=0.0,
            skipped=0,
            reinserted=0,
            verify_failures={},
            failed_devices={},
            direct=False,
            devices=(),
        )

    def close(self) -> None:
        pass
