# The native row kernel (_rows.c), as its callers see it.
from typing import Any

STREAMING: int

def copy_rows(dsts: Any, srcs: Any, sizes: Any, streaming: bool, /) -> None: ...
