"""kvseal: a KV-cache storage engine for LLM inference whose namespaces are sealed by the KV layout."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("kvseal")  # one source: pyproject.toml, through the installed package's metadata
except PackageNotFoundError:  # a source tree on sys.path that was never installed
    __version__ = "0+unknown"
