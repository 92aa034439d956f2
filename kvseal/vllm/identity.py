"""The default client namespace of a model: who it is, not how it is laid out (the seal adds that).

    identity = "<name>@<revision>:<digest12>"
    digest   = sha256 over, in name order: every config/tokenizer file's bytes, and every weight file's name, size
               and first MiB

so two fine-tunes of one architecture (same config, other weights) never share a namespace, while reading only a
few MiB of a large checkpoint. Pure file reads; no vLLM import.
"""

from __future__ import annotations

import hashlib
import os
import re

_CONFIG_SUFFIXES = (".json", ".txt", ".model", ".tiktoken", ".py", ".yaml", ".jinja")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".npz")
_HEAD_BYTES = 1 << 20
_UNSAFE = re.compile(r"[^A-Za-z0-9._:/@+=-]")


def model_identity(model: str, revision: str | None = None) -> str:
    """The namespace for `model` (a local directory or a hub name) at `revision`."""
    name = model.rstrip("/") if not os.path.isdir(model) else os.path.basename(os.path.abspath(model))
    digest = hashlib.sha256()
    if os.path.isdir(model):
        for entry in sorted(os.listdir(model)):
            path = os.path.join(model, entry)
            if not os.path.isfile(path):
                continue
            if entry.endswith(_CONFIG_SUFFIXES):
                digest.update(b"config\0" + entry.encode() + b"\0")
                with open(path, "rb") as f:
                    digest.update(f.read())
            elif entry.endswith(_WEIGHT_SUFFIXES):
                size = os.path.getsize(path)
                digest.update(b"weights\0" + entry.encode() + b"\0" + str(size).encode() + b"\0")
                with open(path, "rb") as f:
                    digest.update(f.read(_HEAD_BYTES))
    else:
        digest.update(b"name\0" + model.encode())
    text = f"{name}@{revision or 'local'}:{digest.hexdigest()[:12]}"
    return _UNSAFE.sub("_", text)[:200]
