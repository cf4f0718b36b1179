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
