# The native byte-moving kernel (_rows.c), as its callers see it.
from typing import Any

STREAMING: int

def copy_rows(dsts: Any, srcs: Any, sizes: Any, streaming: bool, /) -> None: ...
def copy_blocks(
    address: Any,
    pitch: Any,
    width: Any,
    page_offset: Any,
    block_ids: Any,
    pages: Any,
    to_pool: bool,
    streaming: bool,
    /,
) -> None: ...
def load_xxh3(path: str, /) -> bool: ...
def checksums(buffers: Any, /) -> list[int]: ...
