"""The one native part of kvseal: its byte-moving kernel (kvseal/copy/_rows.c). Optional: when it cannot be
built, kvseal copies with numpy instead (kvseal.copy.copier chooses at import)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("kvseal.copy._rows", ["kvseal/copy/_rows.c"], extra_compile_args=["-O2"], optional=True),
    ]
)
