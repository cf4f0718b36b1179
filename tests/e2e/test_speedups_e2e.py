"""compat.pyinfra_speedups keeps pyinfra's operation order: a --dry run of a twin gives the
same operations in the same order (pyinfra's `opOrder`/`opHash` debug lines) with the shim on
and off (PVEGPU_PYINFRA_SPEEDUPS=0)."""

from __future__ import annotations

import re

import pytest

from tests.e2e.harness import run_pyinfra

pytestmark = [pytest.mark.twin]

ORDER = re.compile(r"Adding operation, (.*), opOrder=(\([^)]*\)), opHash=(\S+)")


def test_operation_order_with_and_without_the_shim(twin_factory):
    twin = twin_factory("kpro6", name="e2e-speedups")
    orders = {}
    for flag in ("0", "1"):
        run = run_pyinfra("inventories/twin.py", "deploy.py", "--dry",
                          env={"PVEGPU_TWINS": twin.name, "PVEGPU_PYINFRA_SPEEDUPS": flag})
        assert run.rc == 0, run.output[-4000:]
        orders[flag] = ORDER.findall(run.output)
    assert len(orders["1"]) >= 10, "no operations seen in --debug output"
    assert orders["1"] == orders["0"]
