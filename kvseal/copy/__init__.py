"""Byte movers, below the engine and the SSD tier that use them: the native row kernel (`_rows.c`, `kernel.py`), the
rows of a batch (`rows.py`), CUDA copies (`cuda.py`) and a worker's copier between its KV memory and pool pages
(`copier.py`)."""
