"""kvseal's native part, two small modules: the byte-moving kernel (kvseal/copy/_rows.c) and the page table's
batch loops (kvseal/core/_table.c). Optional: when they cannot be built, kvseal copies with numpy and runs the
page table's Python reference instead (kvseal.copy.kernel and kvseal.core.pages choose at import)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvseal.copy._rows", ["kvseal/copy/_rows.c"], extra_compile_args=["-O2"], libraries=["dl"], optional=True
        ),
        Extension("kvseal.core._table", ["kvseal/core/_table.c"], extra_compile_args=["-O2"], optional=True),
    ]
)
