"""Build frtools' native parts. Each is optional: without a C++17 compiler frtools still
installs, the recorder warns once and leaves training unrecorded, and the analyzer reads
PyTorch pickles in Python."""

from setuptools import Extension, setup


def native(
    name: str, source: str, optimize: tuple[str, ...] = ("-O2",), **options: list[str]
) -> Extension:
    return Extension(
        name,
        sources=[source],
        language="c++",
        extra_compile_args=["-std=c++17", *optimize, "-fvisibility=hidden", "-Wall"],
        optional=True,
        **options,
    )


setup(
    ext_modules=[
        # the recorder's black box: mmap'd ring buffer, GIL-free watchdog
        native(
            "frtools.recorder._blackbox",
            "frtools/recorder/_native/blackbox.cpp",
            extra_link_args=["-pthread"],
            libraries=["dl"],
            depends=["frtools/recorder/_native/box_api.h"],
        ),
        # call-stack ids cached in C (without it the recorder walks stacks in Python)
        native("frtools.recorder._callsite", "frtools/recorder/_native/callsite.cpp"),
        # Flight Recorder pickles parsed into columns without the GIL (without it the reader
        # uses its restricted Python unpickler). Its VM loop parses ~7% faster at -O3 without
        # the -fwrapv of Python's own flags (it relies on no signed overflow)
        native(
            "frtools.analyze.readers._frpickle",
            "frtools/analyze/readers/_native/frpickle.cpp",
            optimize=("-O3", "-fno-wrapv"),
        ),
    ],
)
