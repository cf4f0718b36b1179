"""facts.gpu.parse_bus_ids on nvidia-smi's real bus id format (recorded on the H200 machine)."""

from facts.gpu import parse_bus_ids
from tests.unit.test_p2p import fixture_lines


def test_real_output_of_the_host_checks_command_becomes_the_specs_bdf():
    # exactly what tests/host runs inside a CT: --query-gpu=pci.bus_id --format=csv,noheader
    assert parse_bus_ids(fixture_lines("h200-vm/query-bus-id.txt")) == ["0000:00:06.0"]


def test_real_bus_id_column_becomes_the_specs_bdf():
    # `--query-gpu=index,pci.bus_id,uuid`: the bus id is the second column
    lines = [line.split(",")[1] for line in fixture_lines("h200-vm/query-gpu-noheader.txt")]
    assert parse_bus_ids(lines) == ["0000:00:06.0"]


def test_several_gpus_sorted_lower_case_and_noise_ignored():
    out = ["00000000:C1:00.0", "00000000:01:00.0", "", "No devices were found"]
    assert parse_bus_ids(out) == ["0000:01:00.0", "0000:c1:00.0"]
