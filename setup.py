"""The one native part of kvseal: its byte-moving kernel (kvseal/engine/_rows.c). Optional: when it cannot be
built, kvseal copies with numpy instead (kvseal.engine.copy chooses at import)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("kvseal.engine._rows", ["kvseal/engine/_rows.c"], extra_compile_args=["-O2"], optional=True),
    ]
)
