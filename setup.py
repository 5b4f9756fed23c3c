"""Build the recorder's native black box (optional: without a compiler frtools still installs,
and the recorder warns once and leaves training unrecorded)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "frtools.recorder._blackbox",
            sources=["frtools/recorder/_native/blackbox.cpp"],
            language="c++",
            extra_compile_args=["-std=c++17", "-O2", "-fvisibility=hidden", "-Wall"],
            extra_link_args=["-pthread"],
            libraries=["dl"],
            optional=True,
        ),
        # call-stack ids cached in C (optional: without it the recorder walks stacks in Python)
        Extension(
            "frtools.recorder._callsite",
            sources=["frtools/recorder/_native/callsite.cpp"],
            language="c++",
            extra_compile_args=["-std=c++17", "-O2", "-fvisibility=hidden", "-Wall"],
            optional=True,
        ),
        # Flight Recorder pickles parsed into columns without the GIL (optional: without it
        # the reader uses its restricted Python unpickler)
        Extension(
            "frtools.analyze.readers._frpickle",
            sources=["frtools/analyze/readers/_native/frpickle.cpp"],
            language="c++",
            extra_compile_args=["-std=c++17", "-O2", "-fvisibility=hidden", "-Wall"],
            optional=True,
        ),
    ],
)
