"""PciAcs reads each bridge's ACS Control from its sysfs `config` (PCIe extended capability
0x000D, control word at +6), on synthetic sysfs trees run through the fact's own command."""

import struct
import subprocess

import pytest

from facts.pci import PciAcs


def config(size: int = 4096, caps=()) -> bytes:
    """Config space bytes: vendor/device, then the extended capabilities ``[(id, control)]``
    chained from 0x100, 0x40 apart (the ACS one with Capability 0x5f)."""
    data = bytearray(size)
    struct.pack_into("<HH", data, 0, 0x1022, 0x14AB)
    offset = 0x100
    for index, (cap_id, ctl) in enumerate(caps):
        following = offset + 0x40 if index + 1 < len(caps) else 0
        struct.pack_into("<I", data, offset, cap_id | (1 << 16) | (following << 20))
        if cap_id == 0x000D:
            struct.pack_into("<HH", data, offset + 4, 0x5F, ctl)
        offset = following
    return bytes(data)


def read_acs(tmp_path, devices: dict) -> tuple[dict, str]:
    for bdf, (cls, data) in devices.items():
        d = tmp_path / "sys/bus/pci/devices" / bdf
        d.mkdir(parents=True)
        (d / "class").write_text(cls + "\n")
        (d / "config").write_bytes(data)
    command = PciAcs().command.replace("/sys/", f"{tmp_path}/sys/")
    # no lspci on PATH: only the config walk speaks
    run = subprocess.run(["sh", "-c", command], capture_output=True, text=True, timeout=60,
                         env={"PATH": "/usr/bin:/bin"})
    return PciAcs().process(run.stdout.splitlines()), run.stdout


def test_acs_found_after_other_capabilities_and_its_control_bits_named(tmp_path):
    acs, _ = read_acs(tmp_path, {
        "0000:40:01.1": ("0x060400", config(caps=[(0x0001, 0), (0x000B, 0), (0x000D, 0x1D)])),
        "0000:41:00.0": ("0x030200", config(caps=[(0x000D, 0x1D)])),  # not a bridge: not read
    })
    assert set(acs) == {"0000:40:01.1"}
    entry = acs["0000:40:01.1"]
    assert entry["status"] == "enabled" and entry["redirect"] is True
    assert [flag for flag, on in entry["ctl"].items() if on] == ["SrcValid", "ReqRedir", "CmpltRedir", "UpstreamFwd"]


@pytest.mark.parametrize("data, status", [
    (config(caps=[(0x000D, 0)]), "disabled"),        # ACS present, all off
    (config(caps=[(0x0001, 0)]), "absent"),          # extended space, no ACS capability
    (config(4096), "absent"),                         # extended space empty
    (config(256), "absent"),                          # conventional PCI bridge: no extended space
    (config(64), "unknown"),                          # what a non-root reader gets
])
def test_each_config_form_gives_its_status(tmp_path, data, status):
    acs, _ = read_acs(tmp_path, {"0000:00:01.1": ("0x060400", data)})
    assert acs["0000:00:01.1"]["status"] == status


def test_a_capability_list_that_loops_ends(tmp_path):
    data = bytearray(config(caps=[(0x0001, 0)]))
    struct.pack_into("<I", data, 0x100, 0x0001 | (1 << 16) | (0x100 << 20))  # next points at itself
    acs, _ = read_acs(tmp_path, {"0000:00:01.1": ("0x060400", bytes(data))})
    assert acs["0000:00:01.1"]["status"] == "absent"


def test_config_answer_wins_over_lspci_text_for_the_same_bridge():
    lines = ["bridge 0000:00:01.1", "acs 0000:00:01.1 0 1024",
             "0000:00:01.1 0604: 1022:14ab", "\t\tACSCtl:\tSrcValid+ TransBlk- ReqRedir+ CmpltRedir+ UpstreamFwd+"]
    assert PciAcs().process(lines)["0000:00:01.1"]["status"] == "disabled"


MIXED = {
    "0000:00:01.1": ("0x060400", config(caps=[(0x0001, 0), (0x000B, 0), (0x000D, 0x1D)])),
    "0000:00:01.2": ("0x060400", config(caps=[(0x000D, 0)])),
    "0000:00:02.0": ("0x060000", config(caps=[(0x000D, 0x1D)])),  # a host bridge (0x0600): not read
    "0000:00:03.1": ("0x060400", config(256)),
    "0000:40:01.1": ("0x060400", config(caps=[(0x0001, 0)])),
    "0000:40:03.1": ("0x060401", config(64)),  # subtractive decode bridge, read short
    "0000:41:00.0": ("0x030200", config(caps=[(0x000D, 0x1D)])),
}


def _sysfs(tmp_path, devices: dict, tools: dict[str, str] | None = None) -> dict:
    """A sysfs tree of `devices` and an env whose PATH logs every od (and holds `tools`: name -> sh)."""
    for bdf, (cls, data) in devices.items():
        d = tmp_path / "sys/bus/pci/devices" / bdf
        d.mkdir(parents=True)
        (d / "class").write_text(cls + "\n")
        (d / "config").write_bytes(data)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in {"od": f'echo od >> {tmp_path}/od.log; exec /usr/bin/od "$@"', **(tools or {})}.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    return {"PATH": f"{bin_dir}:/usr/bin:/bin"}


def _out(tmp_path, command: str, env: dict) -> str:
    return subprocess.run(["sh", "-c", command.replace("/sys/", f"{tmp_path}/sys/")], capture_output=True, text=True,
                          timeout=60, env=env).stdout


# The oracle: the per-bridge walk the fact ran in the shell before its fallback fed the awk (one od
# per bridge, the extended capability list walked with shell arithmetic).
_ACS_PER_BRIDGE = (
    "u=; for d in /sys/bus/pci/devices/*; do "
    'c=; { read -r c; } 2>/dev/null < "$d/class"; '
    'case "$c" in 0x0604*) ;; *) continue;; esac; '
    'b=${d##*/}; echo "bridge $b"; '
    'set -- $(od -An -tu4 -v "$d/config" 2>/dev/null); '
    'if [ $# -lt 64 ]; then u=1; echo "acs $b short $#"; continue; fi; '
    "r=none; if [ $# -ge 1024 ]; then o=256; k=0; "
    "while [ $o -ge 256 ] && [ $k -lt 960 ]; do "
    'eval "h=\\${$((o / 4 + 1))}"; case $h in 0|4294967295) break;; esac; '
    'if [ $((h & 65535)) -eq 13 ]; then eval "w=\\${$((o / 4 + 2))}"; r=$((w >> 16)); break; fi; '
    "o=$((h >> 20 & 4092)); k=$((k + 1)); done; fi; "
    'echo "acs $b $r $#"; '
    "done"
)


def test_one_od_reads_every_bridge_and_prints_what_one_od_per_bridge_prints(tmp_path):
    env = _sysfs(tmp_path, MIXED)
    out = _out(tmp_path, PciAcs().command, env)
    assert (tmp_path / "od.log").read_text().count("od") == 1  # was one per bridge (5 here)
    (tmp_path / "od.log").unlink()
    assert out == _out(tmp_path, _ACS_PER_BRIDGE + "; true", env)
    assert (tmp_path / "od.log").read_text().count("od") == 5
    acs = PciAcs().process(out.splitlines())
    assert {b: v["status"] for b, v in acs.items()} == {
        "0000:00:01.1": "enabled", "0000:00:01.2": "disabled", "0000:00:03.1": "absent",
        "0000:40:01.1": "absent", "0000:40:03.1": "unknown"}


def test_where_the_words_do_not_add_up_each_bridge_is_read_alone(tmp_path):
    # a config whose size says more than a read gives (as for a reader that gets 64 bytes)
    env = _sysfs(tmp_path, MIXED, {"stat": 'exec /usr/bin/stat "$@" | sed "s/^64 /4096 /"'})
    out = _out(tmp_path, PciAcs().command, env)
    assert (tmp_path / "od.log").read_text().count("od") == 1 + 5  # the one od, then one per bridge
    assert out == _out(tmp_path, _ACS_PER_BRIDGE + "; true", env)
    assert PciAcs().process(out.splitlines())["0000:40:03.1"]["status"] == "unknown"


@pytest.mark.parametrize("reader", ["non-root", "every read short"])
def test_the_fallback_walks_each_bridge_with_the_one_awk_as_the_shell_walk_did(tmp_path, reader):
    """The per-bridge fallback feeds each bridge's od words to the awk the one-od path uses (no
    second walk in the shell): what it prints is what the shell walk printed, for a reader that
    gets 64 bytes of some configs and for one that gets 64 bytes of every config (sysfs sizes
    4096 or 256: pci-sysfs.c pci_read_config gives a non-admin reader 64 bytes)."""
    devices = dict(MIXED)
    if reader == "every read short":
        devices = {bdf: (cls, data[:64]) for bdf, (cls, data) in MIXED.items()}
    env = _sysfs(tmp_path, devices, {"stat": 'exec /usr/bin/stat "$@" | sed "s/^64 /4096 /"',
                                     "awk": f'echo awk >> {tmp_path}/awk.log; exec /usr/bin/awk "$@"'})
    out = _out(tmp_path, PciAcs().command, env)
    assert (tmp_path / "awk.log").read_text().count("awk") == 2  # the one-od walk (refused), the fallback's
    assert out == _out(tmp_path, _ACS_PER_BRIDGE + "; true", env)
    assert "eval" not in PciAcs().command and "$((" not in PciAcs().command  # no shell walk left
    acs = PciAcs().process(out.splitlines())
    if reader == "every read short":
        assert {v["status"] for v in acs.values()} == {"unknown"} and len(acs) == 5
    else:
        assert acs["0000:00:01.1"]["status"] == "enabled" and acs["0000:40:03.1"]["status"] == "unknown"


def guest_gpu_config(clique: int | None, at: int = 0xD4) -> bytes:
    """A guest GPU's config space with the standard capability chain lspci -v printed for a Tesla
    T4 passed to a cloud VM (public CUDA driver notes, search-index file id 44355206012: [60] Power
    Management, [68] #00, [78] Express Endpoint, [c8] MSI-X, [d4] Vendor Specific Information:
    Len=08) and, at the last one, the Virtual P2P Approval capability as QEMU's
    vfio_add_nv_gpudirect_cap() writes it (ID 9, length 8, "P2P", clique << 3; at 0xD4 where
    MSI-X holds 0xC8). ``clique=None``: a vendor capability without the signature."""
    data = bytearray(4096)
    struct.pack_into("<HH", data, 0, 0x10DE, 0x1EB8)
    data[9:12] = bytes.fromhex("030200")[::-1]
    data[0x34] = 0x60
    chain = [(0x60, 0x01), (0x68, 0x00), (0x78, 0x10), (0xC8, 0x11), (at, 0x09)]
    for index, (offset, cap_id) in enumerate(chain):
        data[offset] = cap_id
        data[offset + 1] = chain[index + 1][0] if index + 1 < len(chain) else 0
    if clique is not None:
        data[at + 2:at + 8] = bytes([8]) + b"P2P" + bytes([clique << 3, 0])
    return bytes(data)


def test_a_guest_gpus_gpudirect_clique_is_read_from_its_config_in_the_same_od(tmp_path):
    """Issue 43 item 7: NVIDIA functions' configs ride in PciAcs's one od; the awk walks their
    capability list as the driver's chipset_pcie.c does and prints the clique (or none)."""
    env = _sysfs(tmp_path, {
        "0000:00:1c.0": ("0x060400", config(caps=[(0x000D, 0)])),
        "0000:01:00.0": ("0x030200", guest_gpu_config(3)),
        "0000:02:00.0": ("0x030200", guest_gpu_config(3, at=0xC8)),  # the QEMU default offset
        "0000:03:00.0": ("0x030200", guest_gpu_config(None)),        # vendor cap, no P2P signature
        "0000:04:00.0": ("0x030200", guest_gpu_config(5)[:64]),      # a non-root reader's 64 bytes
        "0000:05:00.0": ("0x030200", guest_gpu_config(7)),           # not NVIDIA: not read
    })
    for bdf in ("0000:01:00.0", "0000:02:00.0", "0000:03:00.0", "0000:04:00.0"):
        (tmp_path / "sys/bus/pci/devices" / bdf / "vendor").write_text("0x10de\n")
    (tmp_path / "sys/bus/pci/devices/0000:05:00.0/vendor").write_text("0x1002\n")
    out = _out(tmp_path, PciAcs().command, env)
    assert (tmp_path / "od.log").read_text().count("od") == 1
    acs = PciAcs().process(out.splitlines())
    assert {bdf: (e["clique"], e["clique_read"]) for bdf, e in acs.items() if e["status"] == "gpu"} == {
        "0000:01:00.0": (3, True), "0000:02:00.0": (3, True), "0000:03:00.0": (None, True),
        "0000:04:00.0": (None, False)}
    assert acs["0000:00:1c.0"]["status"] == "disabled"
    assert "0000:05:00.0" not in acs
