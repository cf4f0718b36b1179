"""Faster equivalents of two pyinfra internals, installed by deploy.py.

pyinfra (3.10) orders operations by the call stack they were created from:
`pyinfra.api.util.get_operation_order_from_stack` calls `inspect.stack()`, which for every frame
reads its source line (`findsource` → `getmodule`, a scan of `sys.modules`), then `getframeinfo`
again per frame, only to keep file names and line numbers. That is done for every operation on
every host: in a no-change run of 8 twins it was the largest part of pyinfra's own CPU after
imports (bench/fleet_profile.py). `operation_order_from_stack` returns the same list from the
frames' code objects (`co_filename`, `f_lineno`), reading no source.

`pyinfra.api.arguments.all_global_arguments` evaluates the type hints of the `AllArguments`
TypedDict (`typing.get_type_hints`, some thirty annotations through its bases) on every call, and
`pop_global_arguments` calls it for every operation and every fact on every host. The class never
changes during a run: `global_arguments` evaluates it once and hands out a new list each call.

`install()` replaces each function where pyinfra looks it up, only when the installed pyinfra is
the release this was written for (`WRITTEN_FOR`) and the replaced function's source still has the
sha256 it had there (`REPLACED_SOURCE_SHA256`): any other pyinfra runs stock, and the run logs
once why. tests/unit/test_pyinfra_speedups.py checks that both give the same result, that the
gate holds, and tests/e2e/test_speedups_e2e.py that a whole run keeps its operation order.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import inspect
import logging
import os
import sys
from types import FrameType
from typing import Any

import pyinfra

# the modules (pyinfra.api's `operation` attribute is the decorator, not the module)
_operation: Any = importlib.import_module("pyinfra.api.operation")
_util: Any = importlib.import_module("pyinfra.api.util")
_arguments: Any = importlib.import_module("pyinfra.api.arguments")

ORIGINAL = getattr(_util, "get_operation_order_from_stack", None)
ORIGINAL_ARGUMENTS = getattr(_arguments, "all_global_arguments", None)

# What the replacements were written against: pyinfra's release and the sha256 of each replaced
# function's source text there. Either differs -> stock pyinfra (our copy may no longer match).
WRITTEN_FOR = "3.10.0"
REPLACED_SOURCE_SHA256 = {
    "get_operation_order_from_stack": "f4807f61585570e091fd453c7552d9e2b49329555f07f395a8e8f1d2a398a0b2",
    "all_global_arguments": "f7afbc472d78c5d2f0bb282994175647651e888543da001968d903cc4a26a5a1",
}

log = logging.getLogger("pvegpu")


def operation_order_from_stack(state) -> list:
    """What `get_operation_order_from_stack(state)` returns when called from the same place,
    without reading source files."""
    frames = []
    # from the caller: upstream's list starts at its own frame, which (in pyinfra) it skips
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    frames.reverse()  # outermost first, as reversed(inspect.stack())

    i = 0
    # the *first* frame of the deploy file; with none, upstream keeps only its own last frame,
    # which is pyinfra's and skipped: no frame here
    if state.current_deploy_filename:
        i = next((n for n, frame in enumerate(frames) if frame.f_code.co_filename == state.current_deploy_filename),
                 len(frames))

    line_numbers = []
    if pyinfra.is_cli:
        line_numbers.append(state.current_op_file_number)
    for frame in frames[i:]:
        if frame.f_code.co_filename.startswith(_util.PYINFRA_INSTALL_DIR):
            continue
        line_numbers.append(frame.f_lineno)
    return line_numbers


@functools.cache
def _global_arguments() -> tuple:
    if ORIGINAL_ARGUMENTS is None:  # install() puts global_arguments in place only beside the original
        raise RuntimeError("pvegpu: pyinfra.api.arguments.all_global_arguments is missing")
    return tuple(ORIGINAL_ARGUMENTS())


def global_arguments() -> list:
    """What `all_global_arguments()` returns (a new list of (name, type) each call), with the
    type hints evaluated once per process."""
    return list(_global_arguments())


def source_sha256(function) -> str | None:
    """sha256 of a function's source text, None when it has none to read."""
    try:
        return hashlib.sha256(inspect.getsource(function).encode()).hexdigest()
    except (OSError, TypeError):
        return None


def gate_refusal(version: str | None = None, originals: dict | None = None) -> str | None:
    """Why the speedups must not be installed on this pyinfra (None: they may): another release
    than WRITTEN_FOR, or a replaced function missing or with other source."""
    version = pyinfra.__version__ if version is None else version
    if version != WRITTEN_FOR:
        return f"pyinfra {version} is not {WRITTEN_FOR}, which they were written for"
    if originals is None:
        originals = {"get_operation_order_from_stack": ORIGINAL, "all_global_arguments": ORIGINAL_ARGUMENTS}
    for name, function in originals.items():
        if function is None:
            return f"pyinfra has no {name}"
        if source_sha256(function) != REPLACED_SOURCE_SHA256[name]:
            return f"pyinfra's {name} is not the code they were written for"
    return None


_gate_logged = False


def install() -> bool:
    """Use `operation_order_from_stack` in pyinfra's operation module and `global_arguments` in
    its arguments module; False if neither was replaced: the gate refuses this pyinfra (logged
    once per process), they are replaced already, or PVEGPU_PYINFRA_SPEEDUPS=0 (then nothing
    is changed)."""
    global _gate_logged
    if os.environ.get("PVEGPU_PYINFRA_SPEEDUPS") == "0":
        return False
    refusal = gate_refusal()
    if refusal is not None:
        if not _gate_logged:
            log.warning("pvegpu: pyinfra speedups off, stock pyinfra runs: %s", refusal)
            _gate_logged = True
        return False
    done = False
    if ORIGINAL is not None and getattr(_operation, "get_operation_order_from_stack", None) is ORIGINAL:
        _operation.get_operation_order_from_stack = operation_order_from_stack
        done = True
    if ORIGINAL_ARGUMENTS is not None and getattr(_arguments, "all_global_arguments", None) is ORIGINAL_ARGUMENTS:
        _arguments.all_global_arguments = global_arguments  # pop_global_arguments looks it up here
        done = True
    return done
