"""Kernel tests run the Triton kernels on CPU through Triton's interpreter.

Triton picks interpreting or compiling when a kernel is defined, and our kernel modules define
theirs on first use, so setting the variable here, before any test runs a kernel, is enough.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"
