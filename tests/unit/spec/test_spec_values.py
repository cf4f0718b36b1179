"""Issue 19 part 4: every spec value is checked for what it becomes, when the spec loads.

One test (or parametrized row) per class of value: systemd unit names, kernel config lines,
kernel command-line words, counts and sizes, paths on the host, names and identifiers, and
YAML files that are not a spec at all. Each refusal names the file, the host and the field.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path

import pytest
import yaml

from spec.load import MAX_NODES, SpecError, load_spec_file, validate_spec
from spec.values import systemd_unit

REPO = Path(__file__).resolve().parents[3]
KPRO6 = yaml.safe_load((REPO / "inventories" / "kpro6.yml").read_text())


def host() -> dict:
    return copy.deepcopy(KPRO6["hosts"]["kpro6"])


def refused_at(tmp_path: Path, where: tuple[str, ...], value, path: str, words: str) -> str:
    """kpro6's spec with `value` set at the keys `where`, refused naming `path` with `words`."""
    h = host()
    target = h
    for key in where[:-1]:
        target = target[key]
    target[where[-1]] = value
    return refused(tmp_path, h, path, words)


def refused(tmp_path: Path, h: dict, path: str, words: str) -> str:
    f = tmp_path / "site.yml"
    f.write_text(yaml.safe_dump({"hosts": {"kpro6": h}}))
    with pytest.raises(SpecError) as exc:
        load_spec_file(f)
    msg = str(exc.value)
    assert str(f) in msg and "host kpro6" in msg and "Nothing was changed on any host." in msg
    lines = [line for line in msg.splitlines() if f"{path}:" in line]
    assert lines, f"no error for {path} in:\n{msg}"
    assert any(words in line for line in lines), f"{words!r} not in {lines}"
    return msg


def accepted(tmp_path: Path, h: dict):
    return validate_spec({"hosts": {"kpro6": h}}, tmp_path / "site.yml")["kpro6"]


# ------------------------------------------------------------------ systemd unit names

@pytest.mark.parametrize("service, why", [
    ("../../etc/systemd/system/x", "holds '/'"),
    ("vllm server", "holds ' '"),
    ("vllm;reboot", "holds ';'"),
    ("@vllm.service", "starts with '@'"),
    (".vllm", "starts with '.'"),
    (".service", "nothing before the unit type"),
    ("v" * 250, "its drop-in directory '<unit>.d' must fit a file name"),
    ("", "it is empty"),
])
def test_service_names_follow_systemds_unit_name_rules(tmp_path, service, why):
    h = host()
    h["nccl"]["services"] = ["vllm", service]
    refused(tmp_path, h, "hosts.kpro6.nccl.services[1]", why)


def test_service_names_systemd_takes_are_accepted(tmp_path):
    h = host()
    h["nccl"]["services"] = ["vllm", "ray-head.service", "trainer@.service", "trainer@gpu0.service",
                             "ray.socket", "my\\x2dapp", "a:b_c.d"]
    assert accepted(tmp_path, h).nccl.services == h["nccl"]["services"]
    assert [systemd_unit(s) for s in h["nccl"]["services"]][-1] == "a:b_c.d.service"


def test_one_unit_listed_twice_is_refused(tmp_path):
    h = host()
    h["nccl"]["services"] = ["vllm", "vllm.service"]
    refused(tmp_path, h, "hosts.kpro6.nccl.services", "vllm.service listed twice")


# ------------------------------------------------------------------ kernel config lines

@pytest.mark.parametrize("line, words", [
    ("CONFIG_X=y", None), ("CONFIG_NR_CPUS=512", None), ("CONFIG_PHYS_START=0x1000000", None),
    ('CONFIG_LOCALVERSION="-pvegpu \\"x\\""', None), ("# CONFIG_DEBUG_INFO is not set", None),
    ("CONFIG_X=n", None), ("CONFIG_X=m", None), ("CONFIG_X=-1", None),
    ("X=y", "needs its CONFIG_ prefix"),
    ("CONFIG_X=yes", "a value is y, m, n, a number"),
    ("CONFIG_X", "is not a kernel config line"),
    ("config_x=y", "is not a kernel config line"),
    ('CONFIG_X="unterminated', "a value is y, m, n"),
    ("CONFIG_X=y; rm -rf /", "a value is y, m, n"),
    ("PVEGPU_FRAGMENT", "is not a kernel config line"),  # would end the build script's here-document
    ("# CONFIG_X is set", "is not a kernel config line"),
])
def test_config_fragments_are_kconfig_lines(tmp_path, line, words):
    h = host()
    h["kernel"]["source"] = {"kind": "tarball", "url": "/root/linux.tar.xz", "sha256": "0" * 64}
    h["kernel"]["config_fragments"] = ["CONFIG_64BIT=y", line]
    if words is None:
        assert accepted(tmp_path, h).kernel.config_fragments[1] == line
    else:
        refused(tmp_path, h, "hosts.kpro6.kernel.config_fragments[1]", words)


# ------------------------------------------------------------------ kernel command line

@pytest.mark.parametrize("section, key, value, path, words", [
    ("iommu", "params", ["pci=realloc", 'x="$(reboot)"'], "hosts.kpro6.iommu.params", "not '\"$()'"),
    ("iommu", "params", ["pci=realloc", "a`b`"], "hosts.kpro6.iommu.params", "not '`'"),
    ("iommu", "params", [""], "hosts.kpro6.iommu.params", "an empty kernel parameter"),
    ("iommu", "params", ["x=" + "1" * 2100], "hosts.kpro6.iommu.params", "the whole kernel command line holds 2047"),
    ("iommu", "params", ["p" * 40] * 60, "hosts.kpro6.iommu.params", "the whole kernel command line holds 2047"),
    ("iommu", "acs_override", "downstream,everything", "hosts.kpro6.iommu.acs_override", "'everything' in"),
    ("iommu", "acs_override", "id:10de", "hosts.kpro6.iommu.acs_override", "4 hex digits each"),
    ("iommu", "acs_override", ",".join(["id:10de:2bb1"] * 16), "hosts.kpro6.iommu.acs_override", "at most 15 'id:'"),
])
def test_kernel_parameters_are_words_the_kernel_takes(tmp_path, section, key, value, path, words):
    h = host()
    h[section][key] = value
    refused(tmp_path, h, path, words)


def test_usual_kernel_parameters_pass(tmp_path):
    h = host()
    h["iommu"]["params"] = ["pci=realloc", "console=ttyS0,115200n8", "isolcpus=1-3", "hugepagesz=1G",
                            "root=ZFS=rpool/ROOT/pve-1", "vfio-pci.ids=10de:2bb1"]
    h["iommu"]["acs_override"] = "downstream,multifunction,id:10de:2bb1"
    assert accepted(tmp_path, h).iommu.acs_override.endswith("id:10de:2bb1")


# ------------------------------------------------------------------ counts and sizes

@pytest.mark.parametrize("where, value, path, words", [
    (("kernel", "jobs"), 0, "hosts.kpro6.kernel.jobs", "got 0; write 'auto'"),
    (("kernel", "jobs"), 100000, "hosts.kpro6.kernel.jobs", "a number of make jobs from 1 to 4096"),
    (("kernel", "jobs"), True, "hosts.kpro6.kernel.jobs", "got True"),
    (("kernel", "jobs"), "many", "hosts.kpro6.kernel.jobs", "got 'many'"),
    (("guests", "shutdown_timeout"), 0, "hosts.kpro6.guests.shutdown_timeout", "greater than or equal to 1"),
    (("guests", "shutdown_timeout"), 86400, "hosts.kpro6.guests.shutdown_timeout", "less than or equal to 3600"),
    (("guests", "shutdown_timeout"), True, "hosts.kpro6.guests.shutdown_timeout", "write a number"),
    (("ssh", "port"), 0, "hosts.kpro6.ssh.port", "greater than or equal to 1"),
    (("ssh", "port"), 70000, "hosts.kpro6.ssh.port", "less than or equal to 65535"),
    (("containers", 200, "gid"), -1, "hosts.kpro6.containers[200].gid", "greater than or equal to 0"),
    (("containers", 200, "gid"), 100000, "hosts.kpro6.containers[200].gid", "less than or equal to 65535"),
    (("containers", 200, "gid"), False, "hosts.kpro6.containers[200].gid", "write a number"),
    (("nvidia", "nvreg", "NVreg_EnableGpuFirmware"), 2**40, 'hosts.kpro6.nvidia.nvreg["NVreg_EnableGpuFirmware"]',
     "does not fit a 32-bit module parameter"),
    (("nvidia", "nvreg", "NVreg_RegistryDwords"), 'a"b', 'hosts.kpro6.nvidia.nvreg["NVreg_RegistryDwords"]',
     "cannot hold a double quote"),
    (("nvidia", "releases"), ["6.14.8-" + "a" * 70], "hosts.kpro6.nvidia.releases",
     "longer than a kernel release can be (64)"),
    (("nccl", "overrides", "NCCL_DEBUG"), "x" * 1024, 'hosts.kpro6.nccl.overrides["NCCL_DEBUG"]', "at most 1023 bytes"),
])
def test_counts_and_sizes_have_real_ranges(tmp_path, where, value, path, words):
    refused_at(tmp_path, where, value, path, words)


def test_proxmox_api_port_has_a_range(tmp_path):
    h = host()
    h["proxmox_api"] = {"host": "127.0.0.1", "port": 80060, "token_name": "pvegpu", "token_env": "T"}
    refused(tmp_path, h, "hosts.kpro6.proxmox_api.port", "less than or equal to 65535")


# ------------------------------------------------------------------ paths on the host

@pytest.mark.parametrize("where, value, path, words", [
    (("kernel", "base_config"), "/boot/../etc/shadow", "hosts.kpro6.kernel.base_config", "holds '.' or '..'"),
    (("kernel", "base_config"), "/root/./config", "hosts.kpro6.kernel.base_config", "holds '.' or '..'"),
    (("kernel", "base_config"), "/root//config", "hosts.kpro6.kernel.base_config", "no '//'"),
    (("kernel", "base_config"), "../config", "hosts.kpro6.kernel.base_config", "or an absolute path"),
    (("nvidia", "installer", "url"), "file:///opt/nvidia/../../etc/shadow", "hosts.kpro6.nvidia.installer.url",
     "holds '.' or '..'"),
    (("nvidia", "installer", "url"), "file://opt/x.run", "hosts.kpro6.nvidia.installer.url", "not an absolute path"),
    (("nvidia", "installer", "url"), "../NVIDIA.run", "hosts.kpro6.nvidia.installer.url", "a source is an https:// URL"),
    (("nvidia", "installer", "url"), "ftp://example.org/x.run", "hosts.kpro6.nvidia.installer.url",
     "a source is an https:// URL"),
    (("nvidia", "installer", "url"), "/opt/src/", "hosts.kpro6.nvidia.installer.url", "no trailing '/'"),
    # issue 43 item 9: POSIX keeps a leading '//' (posixpath.normpath('//root/x') == '//root/x')
    (("kernel", "base_config"), "//root/config", "hosts.kpro6.kernel.base_config", "no '//'"),
    (("nvidia", "installer", "url"), "//opt/src/x.run", "hosts.kpro6.nvidia.installer.url", "no '//'"),
    (("nvidia", "installer", "url"), "file:////opt/src/x.run", "hosts.kpro6.nvidia.installer.url", "no '//'"),
])
def test_paths_cannot_climb_out(tmp_path, where, value, path, words):
    refused_at(tmp_path, where, value, path, words)


# ------------------------------------------------------------------ names and identifiers

@pytest.mark.parametrize("where, value, path, words", [
    (("ssh", "hostname"), "-oProxyCommand=reboot", "hosts.kpro6.ssh.hostname", "not a host name or IP address"),
    (("ssh", "hostname"), "kpro6 lab", "hosts.kpro6.ssh.hostname", "not a host name or IP address"),
    (("ssh", "user"), "root;reboot", "hosts.kpro6.ssh.user", "not a login name"),
    (("ssh", "key"), " ", "hosts.kpro6.ssh.key", "an empty path"),
    (("node",), "kpro6.lab.internal", "hosts.kpro6.node", "not a Proxmox node name"),
    (("node",), "../kpro7", "hosts.kpro6.node", "not a Proxmox node name"),
])
def test_names_are_what_their_program_takes(tmp_path, where, value, path, words):
    refused_at(tmp_path, where, value, path, words)


@pytest.mark.parametrize("api, path, words", [
    ({"host": "pve/../x"}, "hosts.kpro6.proxmox_api.host", "not a host name"),
    ({"user": "root"}, "hosts.kpro6.proxmox_api.user", "write user@realm"),
    ({"token_name": "a!b"}, "hosts.kpro6.proxmox_api.token_name", "not a Proxmox API token name"),
    ({"token_env": "1TOKEN"}, "hosts.kpro6.proxmox_api.token_env", "not an environment variable name"),
])
def test_proxmox_api_identifiers(tmp_path, api, path, words):
    h = host()
    h["proxmox_api"] = {"host": "pve1.lab.internal", "user": "pvegpu@pve", "token_name": "deploy",
                        "token_env": "PVEGPU_TOKEN", **api}
    refused(tmp_path, h, path, words)


def test_ip_addresses_and_names_pass(tmp_path):
    h = host()
    h["ssh"] = {"hostname": "fd00::6", "user": "deploy", "port": 2222}
    h["proxmox_api"] = {"host": "10.0.0.6", "user": "ops@ldap.example", "token_name": "pvegpu.ci",
                        "token_env": "PVEGPU_TOKEN"}
    spec = accepted(tmp_path, h)
    assert spec.ssh.hostname == "fd00::6" and spec.proxmox_api.user == "ops@ldap.example"


# ------------------------------------------------------------------ files that are not a spec

BILLION_LAUGHS = """\
a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]
b: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]
c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]
d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]
e: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]
f: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e]
g: &g [*f,*f,*f,*f,*f,*f,*f,*f,*f]
h: &h [*g,*g,*g,*g,*g,*g,*g,*g,*g]
i: &i [*h,*h,*h,*h,*h,*h,*h,*h,*h]
hosts:
  kpro6:
    iommu: {params: *i}
"""


@pytest.mark.parametrize("text, words", [
    ("", "is empty"),
    ("# only a comment\n", "is empty"),
    ("- kpro6\n", "holds a list, not a mapping"),
    ("kpro6\n", "holds a string, not a mapping"),
    ("nodes: {}\n", "top-level 'hosts:' mapping"),
    ("hosts:\n", "at least one host"),
    ("hosts: {}\n", "at least one host"),
    ("hosts: [kpro6]\n", "at least one host"),
    (BILLION_LAUGHS, f"expands to more than {MAX_NODES} values"),
    ("hosts: &h\n  kpro6: {iommu: {params: *h}}\n", "refers to a node that contains it"),
    ("hosts: {kpro6: {iommu: {params: " + "[" * 5000 + "]" * 5000 + "}}}\n", "nested"),
    ("hosts:\n  ? [a, b]\n  : {}\n", "a key here is a list or mapping"),
    ("hosts: {kpro6: !!python/object/apply:os.system [reboot]}\n", "could not determine a constructor"),
    ("hosts: {kpro6: {}}\n---\nhosts: {kpro7: {}}\n", "expected a single document"),
    ("hosts: {kpro6: {ssh: {hostname: [unclosed}}\n", "(yaml)"),
])
def test_files_that_are_not_a_spec_are_refused_fast_with_a_sentence(tmp_path, text, words):
    f = tmp_path / "site.yml"
    f.write_text(text)
    start = time.monotonic()
    with pytest.raises(SpecError) as exc:
        load_spec_file(f)
    assert time.monotonic() - start < 2
    msg = str(exc.value)
    assert str(f) in msg and words in msg, msg
    assert "Traceback" not in msg


@pytest.mark.parametrize("make, words", [
    (lambda p: p.write_bytes(b"hosts:\n  kpro6: {node: \xff\xfe}\n"), "is not UTF-8 text"),
    (lambda p: p.mkdir(), "is a directory"),
    (lambda p: p.write_text("hosts: {kpro6: {}}\n" + "#" * (1 << 20)), "a host spec is a few KiB"),
    (lambda p: None, "file not found"),
])
def test_unreadable_files_are_refused_with_a_sentence(tmp_path, make, words):
    f = tmp_path / "site.yml"
    make(f)
    with pytest.raises(SpecError, match=words):
        load_spec_file(f)


def test_aliases_that_do_not_multiply_are_fine(tmp_path):
    f = tmp_path / "site.yml"
    f.write_text("common: &gpus ['0000:01:00.0']\n"
                 "hosts:\n  kpro6:\n    gpus: {'0000:01:00.0': lxc}\n    containers: {200: {gpus: *gpus}}\n")
    with pytest.raises(SpecError, match="unknown key 'common'"):  # the anchor's home is not a spec key
        load_spec_file(f)
    f.write_text("hosts:\n  kpro6:\n    gpus: {'0000:01:00.0': lxc}\n"
                 "    containers: {200: {gpus: &g ['0000:01:00.0']}, 201: {gpus: []}}\n"
                 "    nccl: {services: [vllm]}\n")
    assert load_spec_file(f)["kpro6"].containers[200].gpus == ["0000:01:00.0"]


def test_a_billion_laughs_spec_stops_pyinfra_before_any_connection(tmp_path):
    import subprocess
    import sys

    (tmp_path / "site.yml").write_text(BILLION_LAUGHS)
    (tmp_path / "site.py").write_text("from pathlib import Path\nfrom spec.load import inventory_hosts\n"
                                      "gpu_hosts = inventory_hosts(Path(__file__).with_suffix('.yml'))\n")
    start = time.monotonic()
    proc = subprocess.run([str(Path(sys.executable).with_name("pyinfra")), "-y", str(tmp_path / "site.py"),
                           str(REPO / "deploy.py"), "--dry"], cwd=REPO, capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert f"expands to more than {MAX_NODES} values" in out and "Traceback" not in out
    assert "Connecting to hosts" not in out
    assert time.monotonic() - start < 30


# ------------------------------------------------------------------ GPU pools (issue 26)

@pytest.mark.parametrize("pool, words", [
    ("1gpu", "is not a Proxmox mapping id"),
    ("r", "is not a Proxmox mapping id"),
    ("rtx 6000", "is not a Proxmox mapping id"),
    ("rtx6000;reboot", "is not a Proxmox mapping id"),
    ("pvegpu-kpro6-0000-81-00-0", "pvegpu's per-node mappings"),
])
def test_pool_names_are_mapping_ids_pvegpu_does_not_own(tmp_path, pool, words):
    h = host()
    h["vms"][300]["pool"] = pool
    refused(tmp_path, h, "vms[300].pool", words)


def test_a_mapping_id_is_a_pool_name(tmp_path):
    h = host()
    h["vms"][300]["pool"] = "RTX_6000-blackwell"
    assert accepted(tmp_path, h).vms[300].pool == "RTX_6000-blackwell"


# ------------------------------------------------------------------ versions: ASCII digits (issue 43 item 9)

@pytest.mark.parametrize("where, value, path, words", [
    # Python's \d matches every Unicode digit: FULLWIDTH DIGIT SIX, ARABIC-INDIC DIGIT FIVE, DEVANAGARI ONE
    (("kernel", "version"), "6.14\uff16", "hosts.kpro6.kernel.version", "not a kernel release"),
    (("kernel", "version"), "6.14.8-2-pve".replace("8", "\u0968"), "hosts.kpro6.kernel.version", "not a kernel release"),
    (("nvidia", "version"), "595.71.\u0665", "hosts.kpro6.nvidia.version", "not an NVIDIA driver version"),
    (("nvidia", "releases"), ["6.\u0661.0-57-amd64"], "hosts.kpro6.nvidia.releases", "not a kernel release"),
])
def test_versions_are_ascii_digits(tmp_path, where, value, path, words):
    refused_at(tmp_path, where, value, path, words)


def test_a_vm_role_is_ascii_digits(tmp_path):
    """int() reads '\u0663\u0660\u0660' (ARABIC-INDIC 300) as 300: the role must not become VM 300."""
    h = host()
    gpu = next(bdf for bdf, role in h["gpus"].items() if str(role).startswith("vm:"))
    h["gpus"][gpu] = "vm:\u0663\u0660\u0660"
    refused(tmp_path, h, f'hosts.kpro6.gpus["{gpu}"].role', "is not a role")
