"""facts.pci.parse_pci_devices reads both listings of one machine's sysfs the same way: the
fact's own output (link headers, then one grep of every attribute, each resource table cut to
its BAR lines 0-5 by `grep -m 6`) and the per-function form
scripts/record-gpu-host.sh records (attributes and a resource table under each header). Both
were recorded on the H200 VM (tests/fixtures/h200-vm/)."""

from pathlib import Path

from facts.pci import parse_pci_devices

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "h200-vm"


def _parse(name: str) -> dict:
    lines = (FIXTURES / name).read_text().splitlines()
    return parse_pci_devices([line for line in lines if not line.startswith("# ")])


def test_fact_form_and_recorder_form_give_the_same_devices():
    fact, recorder = _parse("sysfs-pci-fact.txt"), _parse("sysfs-pci.txt")
    assert fact == recorder
    gpu = fact["0000:00:06.0"]
    assert (gpu["vendor"], gpu["device"], gpu["class"], gpu["driver"]) == ("10de", "2335", "030200", "nvidia")
    assert gpu["bars"] and max(gpu["bars"].values()) >= 64 << 30  # the H200's large BAR


def test_grep_lines_of_an_unlisted_function_are_ignored():
    lines = ["== 0000:00:01.0 -> /sys/devices/pci0000:00/0000:00:01.0", "0000:00:01.0/vendor:0x8086",
             "0000:00:02.0/vendor:0x10de", "0000:00:01.0/resource:0x00000000fe000000 0x00000000fe0fffff 0x0000000000040200"]
    devices = parse_pci_devices(lines)
    assert list(devices) == ["0000:00:01.0"]
    assert devices["0000:00:01.0"]["vendor"] == "8086" and devices["0000:00:01.0"]["bars"] == {0: 1 << 20}


def test_lspci_numeric_and_named_headers_read_the_same():
    """PciAcs runs `lspci -D -n -vvv`; both forms were recorded in one run on the H200 VM (lspci
    carried in): only the headers differ, and the parser reads the address from either."""
    from facts.pci import parse_acs

    def lines(name):
        return [line for line in (FIXTURES / name).read_text().splitlines() if not line.startswith("# ")]

    named, numeric = lines("lspci-D-vvv.txt"), lines("lspci-D-n-vvv.txt")
    assert named != numeric and len(named) == len(numeric)
    assert parse_acs(named) == parse_acs(numeric)
    assert len(parse_acs(numeric)) == 7 and parse_acs(numeric)["0000:00:06.0"]["status"] == "absent"

