"""The converge's stages, one module each, in the order deploy.py runs them (DESIGN.md §2)."""

from __future__ import annotations

import importlib
from types import ModuleType

STAGES = [
    ("host kernel & IOMMU", "operations.boot"),
    ("kernel", "operations.kernel"),
    ("NVIDIA open driver", "operations.nvidia"),
    ("kernel updates", "operations.kernel_hook"),  # the hook builds nvidia for kernels apt installs later
    ("module options", "operations.module_options"),
    ("GPU assignment", "operations.gpus"),
    ("guests", "operations.guests"),
    ("container user space", "operations.containers"),
    ("NCCL environment", "operations.nccl"),
    ("side effects once", "operations.handlers"),  # after every stage that notifies a handler
    ("reboot policy", "operations.reboot"),
]


class MissingStage(ImportError):
    """A stage module named in STAGES that cannot be imported (a typo must not drop a stage)."""


def load_stages(stages: list[tuple[str, str]] = STAGES) -> list[tuple[str, ModuleType]]:
    """(name, module) for every stage, in order; MissingStage names the stage and module when one
    does not exist. An import error *inside* a stage module is raised as it is."""
    loaded = []
    for name, module_name in stages:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name != module_name:
                raise
            raise MissingStage(f"pvegpu: stage {name!r}: module {module_name} does not exist") from None
        if not hasattr(module, "apply"):
            raise MissingStage(f"pvegpu: stage {name!r}: module {module_name} has no apply(spec)")
        loaded.append((name, module))
    return loaded


def run_stages(host, stages: list[tuple[str, ModuleType]], method: str, spec) -> None:
    """Call each stage's `method` (``apply``, ``after_reboot``; skipped where a stage has none) with
    `spec`, each under its own place in pyinfra's loop position (`host.loop`).

    pyinfra (3.10, api/operation.py solve_operation_consistency) names an operation by the line
    numbers of the frames from deploy.py down, without the files: every stage is called from
    the same line here, so two stages' operations on equal line numbers of their own modules
    would get one hash, and pyinfra takes operations of one hash on several hosts for ONE
    operation (its `_serial`/`_parallel` must agree: a cluster run where one node's guest
    operation and another node's rolling reboot sat on line 412 stopped with "Cannot have
    different values for `_serial`"). The stage's index in the loop position keeps them apart;
    the same stage's operation on every host still shares its hash."""
    for _name, module in host.loop(stages):
        if hasattr(module, method):
            getattr(module, method)(spec)
