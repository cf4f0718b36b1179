"""Pure decisions of the NVIDIA driver and module-options stages (plan/nvidia.py), on real outputs."""

from pathlib import Path

import pytest

from facts.compilers import compiler_version
from facts.kernel import parse_module_parameters
from facts.nvidia import parse_driver_version, parse_gpu_information
from plan import nvidia as nv
from spec.models import SourceSpec

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"

# Real banners: this build machine's `gcc --version | head -n1` / `gcc-12 --version | head -n1`
# (Debian bookworm) and CONFIG_CC_VERSION_TEXT of Debian's linux-headers-6.1.0-57-amd64.
BOOKWORM_GCC = "gcc (Debian 12.2.0-14+deb12u1) 12.2.0"
BOOKWORM_GCC12 = "gcc-12 (Debian 12.2.0-14+deb12u1) 12.2.0"
DEBIAN_61_CC_TEXT = "gcc-12 (Debian 12.2.0-14+deb12u1) 12.2.0"
# Proxmox's kernels are built on the release's first GCC revision (as in kpro6's /proc/version).
PVE_CC_TEXT = "gcc (Debian 12.2.0-14) 12.2.0"


def fixture_lines(relpath: str) -> list[str]:
    return (FIXTURES / relpath).read_text().splitlines()[2:]


def test_targets_are_running_then_kernel_stage_without_duplicates():
    assert nv.target_releases("6.8.12-4-pve", ["6.14.8-2-pve", "6.8.12-4-pve"]) == ["6.8.12-4-pve", "6.14.8-2-pve"]
    assert nv.target_releases(None, []) == []
    assert nv.target_releases("6.8.12-4-pve", ["6.14.8-2-pve"], explicit=["6.1.0-57-amd64"]) == ["6.1.0-57-amd64"]


@pytest.mark.parametrize("cores,mem_kib,jobs", [
    (2, 24683568, 2),      # this build machine (/proc/meminfo MemTotal)
    (16, 131961788, 16),   # the H200 VM (tests/fixtures/h200-vm/meminfo.txt)
    (128, 64 * 1024 * 1024, 32),  # 128 cores, 64 GiB: memory decides (incident 14)
    (8, 1024 * 1024, 1),   # tiny VM: never zero
])
def test_jobs_from_memory_and_cores(cores, mem_kib, jobs):
    assert nv.build_jobs(cores, mem_kib) == jobs


def test_h200_meminfo_fixture_gives_jobs():
    mem = next(int(line.split()[1]) for line in fixture_lines("h200-vm/meminfo.txt") if line.startswith("MemTotal:"))
    assert nv.build_jobs(16, mem) == 16


def test_gcc_version_from_real_banners():
    assert compiler_version(BOOKWORM_GCC) == "12.2.0"
    assert compiler_version(DEBIAN_61_CC_TEXT) == "12.2.0"
    proc_version = fixture_lines("h200-vm/proc-version.txt")[0]  # "(gcc (GCC) 15.3.0, GNU ld … 2.46)"
    assert compiler_version(proc_version.split("(gcc ")[1].split(",")[0]) == "15.3.0"
    driver = parse_driver_version(fixture_lines("driver-version/open-555.42.02-ubuntu2204-ec2-t4.txt"))
    assert driver is not None
    assert driver["gcc"] == "11.4.0"


def test_toolchain_prefers_the_compiler_the_kernel_named():
    result = nv.toolchain_for("6.1.0-57-amd64", DEBIAN_61_CC_TEXT, {"gcc": BOOKWORM_GCC, "gcc-12": BOOKWORM_GCC12})
    assert result == {"cc": "gcc-12", "cxx": None, "note": None, "refusal": None}


def test_toolchain_plain_gcc_matches_when_banner_equal_less_program_name():
    result = nv.toolchain_for("6.1.0-57-amd64", DEBIAN_61_CC_TEXT, {"gcc": BOOKWORM_GCC})
    assert result["cc"] == "gcc" and result["refusal"] is None and result["note"] is None


def test_toolchain_same_gcc_other_debian_revision_is_accepted_with_note():
    result = nv.toolchain_for("6.14.8-2-pve", PVE_CC_TEXT, {"gcc": BOOKWORM_GCC, "gcc-12": BOOKWORM_GCC12})
    assert result["cc"] == "gcc" and result["refusal"] is None
    assert "same GCC 12.2.0" in result["note"]


def test_toolchain_mismatch_refuses_and_names_the_compiler_to_install():
    ubuntu_gcc13 = "gcc (Ubuntu 13.3.0-6ubuntu2~24.04) 13.3.0"  # version line of the 565 fixture's host
    result = nv.toolchain_for("6.1.0-57-amd64", DEBIAN_61_CC_TEXT, {"gcc": ubuntu_gcc13})
    assert result["cc"] is None
    assert "apt install gcc-12" in result["refusal"]
    assert "incident 1" in result["refusal"] and "13.3.0" in result["refusal"]
    pve = nv.toolchain_for("6.14.8-2-pve", PVE_CC_TEXT, {"gcc": ubuntu_gcc13})
    assert "GCC 12.2.0 (apt install gcc-12)" in pve["refusal"]


def test_toolchain_unknown_or_clang_refuses():
    assert "CONFIG_CC_VERSION_TEXT" in nv.toolchain_for("x", None, {"gcc": BOOKWORM_GCC})["refusal"]
    clang = nv.toolchain_for("x", "Debian clang version 14.0.6", {"gcc": BOOKWORM_GCC})
    assert "not GCC" in clang["refusal"]


VERMAGIC_61 = "6.1.0-57-amd64 SMP preempt mod_unload modversions "


def test_module_current_needs_version_and_vermagic_of_the_release():
    mod = {"version": "535.309.01", "vermagic": VERMAGIC_61, "filename": "/lib/modules/6.1.0-57-amd64/updates/pvegpu-nvidia/nvidia.ko"}
    assert nv.module_current("6.1.0-57-amd64", "535.309.01", mod)[0] is True
    assert nv.module_current("6.1.0-57-amd64", "595.71.05", mod) == (
        False, "nvidia 535.309.01 is installed for 6.1.0-57-amd64, want 595.71.05")
    ok, why = nv.module_current("6.1.0-58-amd64", "535.309.01", mod)
    assert not ok and "another kernel" in why
    assert nv.module_current("6.1.0-57-amd64", "535.309.01", None)[0] is False


def test_firmware_missing_for_version_is_refused_unless_installer_brings_it():
    firmware = {"535.261.03": ["gsp_ga10x.bin", "gsp_tu10x.bin"]}
    problem = nv.firmware_problem("535.309.01", firmware, want_firmware=True, installer_configured=False)
    assert problem is not None
    assert "found GSP firmware only for 535.261.03" in problem and "incident 2" in problem
    assert nv.firmware_problem("535.309.01", firmware, True, installer_configured=True) is None
    assert nv.firmware_problem("535.261.03", firmware, True, False) is None
    assert nv.firmware_problem("535.309.01", {}, want_firmware=False, installer_configured=False) is None


def test_userspace_versions_from_library_names():
    assert nv.userspace_versions([
        "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1",
        "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.595.71.05",
        "/usr/lib64/libnvidia-ml.so.595.71.05",
    ]) == ["595.71.05"]


def test_blackwell_by_device_id_and_model():
    assert nv.is_blackwell("2bb5")                      # RTX PRO 6000 Blackwell Server Edition (kpro6)
    assert nv.is_blackwell("2901")                      # B200
    assert not nv.is_blackwell("2335")                  # H200
    assert nv.is_blackwell(model="NVIDIA RTX PRO 6000 Blackwell Server Edition")
    assert nv.is_blackwell(model="NVIDIA GeForce RTX 5090")
    assert not nv.is_blackwell("2204", "NVIDIA GeForce RTX 3090")


def test_hmm_auto_is_off_on_the_real_h200_and_on_for_blackwell():
    gpus = parse_gpu_information(fixture_lines("h200-vm/driver-gpus-information.txt"))
    models = {bdf: g["model"] for bdf, g in gpus.items()}
    assert models and all("H200" in m for m in models.values())
    assert nv.uvm_disable_hmm("auto", {}, models) == (False, "auto: no Blackwell GPU found")
    on, why = nv.uvm_disable_hmm("auto", {"0000:01:00.0": "2bb5", "0000:41:00.0": "2335"})
    assert on and "0000:01:00.0" in why and "0000:41:00.0" not in why and "incident 3" in why
    assert nv.uvm_disable_hmm(True, {}) == (True, "spec sets nvidia.uvm_disable_hmm: true")
    assert nv.uvm_disable_hmm(False, {"0000:01:00.0": "2bb5"})[0] is False


def test_nvidia_gpu_ids_skip_audio_functions():
    pci = {"0000:01:00.0": {"vendor": "10de", "device": "2bb5", "class": "030200"},
           "0000:01:00.1": {"vendor": "10de", "device": "22e8", "class": "040300"},
           "0000:00:01.0": {"vendor": "1022", "device": "149f", "class": "060000"}}
    assert nv.nvidia_gpu_ids(pci) == {"0000:01:00.0": "2bb5"}


def test_h200_uvm_parameters_show_hmm_on():
    params = parse_module_parameters(fixture_lines("h200-vm/uvm-params.txt"))
    assert params["uvm_disable_hmm"] == "N"


def test_modprobe_values_are_quoted_or_refused():
    assert nv.modprobe_value(1) == "1"
    assert nv.modprobe_value(True) == "1"
    assert nv.modprobe_value("0x1") == "0x1"
    assert nv.modprobe_value("RmMsg=:;EnableThing=1") == "RmMsg=:;EnableThing=1"
    assert nv.modprobe_value("a b") == '"a b"'
    assert nv.modprobe_value("") == '""'
    for bad in ['a"b', "a\\b", "a\nb"]:
        with pytest.raises(ValueError):
            nv.modprobe_value(bad)


def test_rendered_options_file():
    text = nv.render_modprobe_conf(True, "spec sets nvidia.uvm_disable_hmm: true",
                                   {"NVreg_EnableGpuFirmware": 1, "NVreg_RegistryDwords": "a=1; b=2"})
    lines = [line for line in text.splitlines() if not line.startswith("#")]
    assert lines == ['options nvidia NVreg_EnableGpuFirmware=1 NVreg_RegistryDwords="a=1; b=2"',
                     "options nvidia_uvm uvm_disable_hmm=1"]
    off = nv.render_modprobe_conf(False, "auto: no Blackwell GPU found", {})
    assert not [line for line in off.splitlines() if line.startswith("options")]


def test_rendered_unit_orders_before_guests():
    unit = nv.render_nodes_unit()
    assert "Before=pve-guests.service" in unit.splitlines()
    assert "ExecStart=nvidia-modprobe -u -c=0" in unit.splitlines()
    assert "WantedBy=multi-user.target" in unit.splitlines()


# -- driver_steps on recorded state (outputs of NvidiaHostState in a bookworm root) ---------

SHA = "04906a73457a207f25dc3dbbb7f8fdc1dc088cc334e6fb2eb9b1419b823bfaaa"
SOURCE = SourceSpec(url="/usr/src/nvidia-kernel.tar.xz", sha256=SHA)


def bookworm_state(module=None, firmware=None, userspace=None, source=None, compilers=None):
    return {
        "cores": 2, "mem_total_kib": 24683568, "running": "6.14.8-2-pve", "ccache": True,
        "compilers": compilers or {"gcc": BOOKWORM_GCC, "gcc-12": BOOKWORM_GCC12},
        "releases": {
            "6.14.8-2-pve": {"headers": False, "cc_version_text": None, "module": None},
            "6.1.0-57-amd64": {"headers": True, "cc_version_text": DEBIAN_61_CC_TEXT, "module": module},
        },
        "firmware": firmware or {}, "userspace": userspace or [],
        "persistenced": {"binary": False, "unit": None, "enabled": False},
        "sources": {"modules": source or {"cached": False, "sha256": SHA}},
    }


def steps(state, releases=("6.1.0-57-amd64",), **kw):
    kw.setdefault("modules_source", SOURCE)
    kw.setdefault("want_firmware", False)
    return nv.driver_steps("535.309.01", list(releases), state, **kw)


def test_steps_build_when_no_module_installed():
    result = steps(bookworm_state())
    assert result["refusals"] == []
    assert result["releases"]["6.1.0-57-amd64"]["build"] is True
    assert result["releases"]["6.1.0-57-amd64"]["cc"] == "gcc-12"
    assert result["fetch_modules"] and result["verify"] and result["jobs"] == 2 and result["ccache"]


def test_steps_skip_when_installed_version_and_vermagic_match():
    result = steps(bookworm_state(module={"version": "535.309.01", "vermagic": VERMAGIC_61, "filename": "x"}))
    assert result["releases"]["6.1.0-57-amd64"]["build"] is False
    assert not result["fetch_modules"] and not result["verify"] and result["refusals"] == []


def test_steps_refuse_local_checksum_mismatch():
    result = steps(bookworm_state(source={"cached": False, "sha256": "f" * 64}))
    assert any("has sha256 ffff" in r and "spec says " + SHA in r for r in result["refusals"])
    # once the verified copy is cached, the original path is not re-read
    assert steps(bookworm_state(source={"cached": True, "sha256": None}))["refusals"] == []


def test_steps_refuse_toolchain_mismatch():
    result = steps(bookworm_state(compilers={"gcc": "gcc (Debian 13.2.0-25) 13.2.0"}))
    assert result["releases"]["6.1.0-57-amd64"]["build"] is False
    assert any("apt install gcc-12" in r for r in result["refusals"])


def test_steps_refuse_firmware_of_another_version():
    result = steps(bookworm_state(firmware={"535.261.03": ["gsp_ga10x.bin"]}), want_firmware=True)
    assert any("found GSP firmware only for 535.261.03" in r for r in result["refusals"])


def test_steps_refuse_foreign_userspace_without_installer():
    result = steps(bookworm_state(userspace=["/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.535.261.03"]))
    assert any("incident 6" in r for r in result["refusals"])


def test_steps_running_kernel_without_headers_refuses_but_kernel_stage_release_is_noted():
    state = bookworm_state()
    refused = steps(state, releases=("6.14.8-2-pve",))
    assert any("proxmox-headers-6.14.8-2-pve" in r for r in refused["refusals"])
    noted = steps(state, releases=("6.1.0-57-amd64", "6.14.8-2-pve"), required={"6.1.0-57-amd64"})
    assert noted["refusals"] == [] and any("skipped until" in n for n in noted["notes"])


def test_steps_without_modules_source_refuse_to_guess():
    result = steps(bookworm_state(), modules_source=None)
    assert any("modules_source is not set" in r for r in result["refusals"])


def test_proprietary_modules_refused_only_with_blackwell_gpus():
    # kpro6: RTX PRO 6000 Blackwell Server Edition (10de:2bb5); intel2: RTX A6000 (10de:2230)
    assert nv.open_modules_problem(True, {"0000:01:00.0": "2bb5"}) is None
    assert nv.open_modules_problem(False, {"0000:01:00.0": "2230"}) is None
    problem = nv.open_modules_problem(False, {"0000:01:00.0": "2230", "0000:41:00.0": "2bb5"})
    assert problem is not None
    assert "0000:41:00.0" in problem and "0000:01:00.0" not in problem and "nvidia.open: true" in problem
    assert "0000:81:00.0" in (nv.open_modules_problem(False, {}, {"0000:81:00.0": "NVIDIA B200"}) or "")


# -- issue 17: the open tree's C++ compiler, objtool -Werror, Secure Boot, GSP firmware per GPU --

def recorded_two_releases() -> dict:
    """NvidiaHostState of the twin root: Debian's 6.1 and bookworm-security's 6.12 headers."""
    from facts.nvidia import parse_host_state

    return parse_host_state(fixture_lines("debian-headers/nvidia-host-state-6.1-and-6.12.118-deb12.txt"))


OPEN_SOURCE = SourceSpec(url="/opt/src/open-gpu-kernel-modules-595.45.04.tar.xz",
                         sha256="654a8bd9d3e2c185073ac5adb2c9aaa9b6134df1c7584366ecf6de400dca8c0b")
TWO = ("6.1.0-57-amd64", "6.12.118+deb12-amd64")


def open_steps(state, **kw):
    kw.setdefault("modules_source", OPEN_SOURCE)
    kw.setdefault("want_firmware", False)
    return nv.driver_steps("595.45.04", list(TWO), state, open_tree=True, **kw)


def test_recorded_state_of_two_releases_builds_both_with_one_gcc_and_gxx():
    state = recorded_two_releases()
    assert state["releases"]["6.12.118+deb12-amd64"]["config"] == {"CONFIG_MITIGATION_RETHUNK": "y", "CONFIG_MODULE_SIG": "y"}
    assert state["releases"]["6.1.0-57-amd64"]["sign_file"] is True and state["secure_boot"] is False
    result = open_steps(state)
    assert result["refusals"] == []
    # 6.12 names x86_64-linux-gnu-gcc-12, which is not installed: gcc-12 like 6.1, so one src/ build serves both
    assert [(e["cc"], e["cxx"]) for e in result["releases"].values()] == [("gcc-12", "g++-12")] * 2


def test_toolchain_refuses_missing_or_other_gxx_for_the_open_tree():
    state = recorded_two_releases()
    no_gxx = {k: v for k, v in state["compilers"].items() if not k.startswith("g++")}
    missing = open_steps({**state, "compilers": no_gxx})
    assert any("$(CXX)" in r and "no g++ at all" in r and "apt install g++-12" in r for r in missing["refusals"])
    other = open_steps({**state, "compilers": {**no_gxx, "g++-12": "g++-12 (Debian 13.2.0-25) 13.2.0"}})
    assert any("13.2.0" in r and "apt install g++-12" in r for r in other["refusals"])
    # the proprietary tree has no C++: gcc alone will do
    assert nv.driver_steps("595.45.04", list(TWO), {**state, "compilers": no_gxx}, modules_source=OPEN_SOURCE,
                           want_firmware=False, open_tree=False)["refusals"] == []


def test_objtool_werror_with_rethunk_refuses_known_warning_trees():
    state = recorded_two_releases()
    state["releases"]["6.12.118+deb12-amd64"]["config"]["CONFIG_OBJTOOL_WERROR"] = "y"
    result = open_steps(state)
    [refusal] = result["refusals"]
    assert refusal.startswith("kernel 6.12.118+deb12-amd64 has CONFIG_OBJTOOL_WERROR=y") and "'naked' return" in refusal
    assert result["releases"]["6.12.118+deb12-amd64"]["build"] is False
    assert result["releases"]["6.1.0-57-amd64"]["build"] is True
    # a newer tree is not known either way: noted, not refused; without -Werror nothing is said
    assert nv.objtool_problem("r", {"CONFIG_OBJTOOL_WERROR": "y", "CONFIG_RETHUNK": "y"}, "595.71.05", True)[0] is None
    assert nv.objtool_problem("r", {"CONFIG_MITIGATION_RETHUNK": "y"}, "595.45.04", True) == (None, None)
    assert nv.objtool_problem("r", {"CONFIG_OBJTOOL_WERROR": "y", "CONFIG_RETHUNK": "y"}, "595.45.04", False) == (None, None)


def test_secure_boot_refuses_unsigned_modules_and_unreadable_keys():
    from spec.models import SigningSpec

    state = {**recorded_two_releases(), "secure_boot": True}
    assert any("Secure Boot is on: the kernel would refuse the unsigned NVIDIA modules, and nvidia.signing is not set"
               in r for r in open_steps(state)["refusals"])
    signing = SigningSpec(key="/root/mok.key", cert="/root/mok.der")
    assert open_steps({**state, "signing_files": {"/root/mok.key": True, "/root/mok.der": True}}, signing=signing)["refusals"] == []
    unreadable = open_steps({**state, "signing_files": {"/root/mok.key": False, "/root/mok.der": True}}, signing=signing)
    assert any("nvidia.signing names /root/mok.key, which is not readable" in r for r in unreadable["refusals"])
    state["releases"]["6.1.0-57-amd64"]["sign_file"] = False
    no_sign_file = open_steps({**state, "signing_files": {"/root/mok.key": True, "/root/mok.der": True}}, signing=signing)
    assert any("kernel 6.1.0-57-amd64: its headers have no scripts/sign-file" in r for r in no_sign_file["refusals"])
    # Secure Boot off, nothing to sign: no refusal
    assert open_steps({**state, "secure_boot": False, "releases": recorded_two_releases()["releases"]})["refusals"] == []


def test_secure_boot_state_from_mokutil_and_the_efi_variable():
    from facts.nvidia import parse_secure_boot

    assert parse_secure_boot(["SecureBoot enabled"]) is True
    assert parse_secure_boot(["SecureBoot disabled", "efivar 0"]) is False
    assert parse_secure_boot(["EFI variables are not supported on this system", "no efi"]) is False
    assert parse_secure_boot(["efivar 1"]) is True and parse_secure_boot(["efivar 0"]) is False
    assert parse_secure_boot([]) is None


SHIM_OFF = Path(__file__).resolve().parents[1] / "fixtures" / "secure-boot" / "issue43-mokutil-sb-state-validation-disabled-in-shim.txt"


def test_secure_boot_validation_disabled_in_shim_enforces_nothing():
    """Issue 43 item 1: `mokutil --sb-state` says "SecureBoot enabled" and then "SecureBoot validation is
    disabled in shim": the kernel turns Secure Boot off (efi_get_secureboot: MokSBState 1), so unsigned
    modules and kernels load; no refusal, and the plan says why."""
    from facts.kernel import parse_build_state
    from facts.nvidia import parse_host_state, secure_boot_state
    from plan.kernel import secure_boot_refusal
    from spec.models import KernelSpec

    lines = SHIM_OFF.read_text().splitlines()[2:]
    assert secure_boot_state(lines) == "validation disabled in shim"
    state = {**recorded_two_releases(), **{k: v for k, v in parse_host_state(["@@ secureboot", *lines]).items()
                                           if k.startswith("secure_boot")}}
    assert state["secure_boot"] is False
    steps = open_steps(state)
    assert steps["refusals"] == []
    assert any("validation disabled in shim" in n for n in steps["notes"])
    # the kernel stage: shim boots an unsigned kernel image
    build = parse_build_state([f"sb {line}" for line in lines] + ["uefi"])
    assert build["secure_boot"] is False and build["secure_boot_state"] == "validation disabled in shim"
    kernel = KernelSpec.model_validate({"version": "6.14.11-9-bpo12-pvegpu-pve", "source": {
        "kind": "proxmox-git", "url": "https://example.invalid/k.git", "ref": "ad58d1445425ea4742e3470b2edbee35df0657e9"}})
    assert secure_boot_refusal(kernel, build) is None
    # the same from the EFI variables (no mokutil): SecureBoot 1, SetupMode 0, shim's MokSBStateRT 1
    assert secure_boot_state(["efivar 1", "setupmode 0", "moksbstate 1"]) == "validation disabled in shim"
    assert secure_boot_state(["efivar 1", "setupmode 1"]) == "setup mode"
    assert secure_boot_state(["SecureBoot disabled", "Platform is in Setup Mode"]) == "setup mode"


def test_gsp_firmware_per_gpu_generation():
    # kpro6: RTX PRO 6000 Blackwell (2bb5); H200 (2335); RTX A6000 (2230); A100 (20b0); T4 (1eb8)
    assert nv.gsp_firmware_for("2bb5") == ("Blackwell", "gsp_ga10x.bin")
    assert nv.gsp_firmware_for("2335") == ("Hopper", "gsp_ga10x.bin")
    assert nv.gsp_firmware_for("2230") == ("Ampere GA10x", "gsp_ga10x.bin")
    assert nv.gsp_firmware_for("20b0") == ("Ampere GA100", "gsp_tu10x.bin")
    assert nv.gsp_firmware_for("1eb8") == ("Turing", "gsp_tu10x.bin")
    assert nv.gsp_firmware_for("1b06") is None  # Pascal: no GSP
    needed = nv.needed_gsp_firmware({"0000:01:00.0": "2bb5", "0000:02:00.0": "2bb5"})
    assert needed == {"gsp_ga10x.bin": ["Blackwell 0000:01:00.0", "Blackwell 0000:02:00.0"]}
    # the version's dir has only the Turing file: the Blackwell GPUs' file is missing
    problem = nv.firmware_problem("595.45.04", {"595.45.04": ["gsp_tu10x.bin"]}, True, False, needed)
    assert problem is not None
    assert "gsp_ga10x.bin for Blackwell 0000:01:00.0, Blackwell 0000:02:00.0" in problem
    assert nv.firmware_problem("595.45.04", {"595.45.04": ["gsp_ga10x.bin"]}, True, False, needed) is None


def test_missing_firmware_reruns_the_installer_the_one_source():
    state = {**recorded_two_releases(), "userspace": ["/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.595.45.04"],
             "firmware": {"595.45.04": ["gsp_tu10x.bin"]}}
    for release in TWO:
        state["releases"][release]["module"] = {"version": "595.45.04", "vermagic": f"{release} SMP", "filename": "x"}
    installer = SourceSpec(url="/opt/nvidia/NVIDIA-Linux-x86_64-595.45.04.run", sha256=SHA)
    gpus = {"0000:01:00.0": "2bb5"}
    result = open_steps(state, installer=installer, want_firmware=True, gpu_ids=gpus)
    assert result["install_userspace"] and result["fetch_installer"] and result["firmware_files"] == ["gsp_ga10x.bin"]
    state["firmware"]["595.45.04"].append("gsp_ga10x.bin")
    result = open_steps(state, installer=installer, want_firmware=True, gpu_ids=gpus)
    assert not result["install_userspace"] and not result["verify"] and result["refusals"] == []


def test_reboot_reason_when_the_loaded_module_is_not_the_installed_one():
    state = {"releases": {"6.8.12-4-pve": {"module": {"version": "595.71.05"}}}}
    steps = {"releases": {"6.8.12-4-pve": {"build": False}}}
    reason = nv.reboot_reason("595.71.05", "580.159.04", "6.8.12-4-pve", steps, state)
    assert reason and "nvidia 580.159.04 is loaded but 595.71.05 is installed for 6.8.12-4-pve" in reason
    # converged (loaded = installed), first install (nothing loaded), nothing of ours for the running kernel
    assert nv.reboot_reason("595.71.05", "595.71.05", "6.8.12-4-pve", steps, state) is None
    assert nv.reboot_reason("595.71.05", None, "6.8.12-4-pve", steps, state) is None
    assert nv.reboot_reason("595.71.05", "580.159.04", "6.8.12-4-pve", steps,
                                {"releases": {"6.8.12-4-pve": {"module": None}}}) is None
    # built this run for the running kernel
    assert nv.reboot_reason("595.71.05", "580.159.04", "6.8.12-4-pve",
                                {"releases": {"6.8.12-4-pve": {"build": True}}}, {"releases": {}})


# -- Secure Boot that loads (issue 28 part 2) ------------------------------------------------

def _signed(state_extra: dict, signing=True):
    from spec.models import SigningSpec

    spec = SigningSpec(key="/root/mok.key", cert="/root/mok.der") if signing else None
    state = {**recorded_two_releases(), "signing_files": {"/root/mok.key": True, "/root/mok.der": True}, **state_extra}
    return open_steps(state, signing=spec)


def test_each_enforcement_source_refuses_unsigned_modules():
    """Secure Boot off but module.sig_enforce=Y, or a target kernel with CONFIG_MODULE_SIG_FORCE=y:
    unsigned modules would not load either."""
    assert _signed({"secure_boot": False, "sig_enforce": False}, signing=False)["refusals"] == []
    enforced = _signed({"secure_boot": False, "sig_enforce": True}, signing=False)["refusals"]
    assert any(r.startswith("module.sig_enforce is Y: the kernel would refuse the unsigned") for r in enforced), enforced
    state = recorded_two_releases()
    state["releases"]["6.1.0-57-amd64"]["config"]["CONFIG_MODULE_SIG_FORCE"] = "y"
    forced = open_steps({**state, "secure_boot": False})["refusals"]
    assert any("kernel 6.1.0-57-amd64 has CONFIG_MODULE_SIG_FORCE=y" in r for r in forced), forced


def test_a_cert_the_kernel_will_not_trust_is_refused_while_enforced():
    for mok, words in (("not enrolled", "is not enrolled as a machine owner key"),
                       ("pending", "is imported but not enrolled: its MokManager confirmation at boot was never done"),
                       ("blocked", "is blocked")):
        refusals = _signed({"secure_boot": True, "mok": mok})["refusals"]
        assert any(f"nvidia.signing.cert /root/mok.der {words}" in r and "Key was rejected by service" in r
                   for r in refusals), (mok, refusals)
    assert _signed({"secure_boot": True, "mok": "enrolled"})["refusals"] == []
    relaxed = _signed({"secure_boot": False, "mok": "not enrolled"})
    assert relaxed["refusals"] == [] and any("nothing enforces them now" in n for n in relaxed["notes"])


def test_unknown_states_are_said_as_such():
    unknown_sb = _signed({"secure_boot": None}, signing=False)
    assert unknown_sb["refusals"] == [] and any(n.startswith("Secure Boot state unknown") for n in unknown_sb["notes"])
    unknown_mok = _signed({"secure_boot": True, "mok": None})
    assert any("enrolment of nvidia.signing.cert /root/mok.der unknown" in n for n in unknown_mok["notes"])
    not_der = _signed({"secure_boot": True, "mok": "not DER"})
    assert any("not a DER certificate" in n and "enrolment unknown" in n for n in not_der["notes"])


def test_a_key_sign_file_cannot_read_is_refused_up_front():
    refusals = _signed({"secure_boot": True, "mok": "enrolled", "signing_key_pem": False})["refusals"]
    assert any("nvidia.signing.key /root/mok.key is not a PEM private key" in r for r in refusals), refusals
    assert _signed({"secure_boot": True, "mok": "enrolled", "signing_key_pem": True})["refusals"] == []


def test_modules_are_signed_with_the_kernels_hash():
    state = recorded_two_releases()
    state["releases"]["6.1.0-57-amd64"]["config"]["CONFIG_MODULE_SIG_HASH"] = "sha512"
    releases = open_steps(state)["releases"]
    assert releases["6.1.0-57-amd64"]["sig_hash"] == "sha512"
    assert all(e["sig_hash"] == "sha256" for r, e in releases.items() if r != "6.1.0-57-amd64" and e["build"])


def test_secure_boot_and_mok_states_parsed_from_the_fact():
    from facts.nvidia import parse_host_state, parse_mok, parse_secure_boot

    assert parse_secure_boot(["efivars not readable"]) is None
    assert parse_secure_boot(["efivars without SecureBoot variable"]) is False
    assert parse_mok(["mok /root/mok.der is not enrolled"]) == "not enrolled"
    assert parse_mok(["mok /root/mok.der is already enrolled"]) == "enrolled"
    assert parse_mok(["mok /root/mok.der is already in the enrollment request"]) == "pending"
    assert parse_mok(["mok Not a valid x509 certificate"]) == "not DER"
    assert parse_mok(["mok unknown: no mokutil"]) is None
    state = parse_host_state(["@@ sig_enforce", "Y", "@@ signing /root/mok.key", "readable",
                              "@@ signing /root/mok.der", "readable", "mok /root/mok.der is not enrolled"])
    assert (state["sig_enforce"], state["signing_key_pem"], state["mok"]) == (True, False, "not enrolled")


# -- Proxmox VE 9 (trixie, GCC 14; issue 29) ------------------------------------------------------
# Real banners of the trixie twin root (debootstrapped; tests/twin/runtime.py): `gcc --version`,
# `gcc-14`/`g++-14 --version` first lines, and CONFIG_CC_VERSION_TEXT of Debian trixie's
# linux-headers-6.12.118+deb13-amd64. Proxmox builds its 9.x kernels with that GCC 14 (the
# kpro6-pve9 profile's /proc/version).
TRIXIE = {"gcc": "gcc (Debian 14.2.0-19) 14.2.0", "gcc-14": "gcc-14 (Debian 14.2.0-19) 14.2.0",
          "g++": "g++ (Debian 14.2.0-19) 14.2.0", "g++-14": "g++-14 (Debian 14.2.0-19) 14.2.0"}
TRIXIE_612_CC_TEXT = "x86_64-linux-gnu-gcc-14 (Debian 14.2.0-19) 14.2.0"
PVE9_CC_TEXT = "gcc (Debian 14.2.0-19) 14.2.0"


def test_pve9_kernels_take_gcc_14():
    assert nv.toolchain_for("7.0.14-14-pve", PVE9_CC_TEXT, TRIXIE, need_cxx=True) == {
        "cc": "gcc", "cxx": "g++", "note": None, "refusal": None}
    # Debian's own trixie kernel names x86_64-linux-gnu-gcc-14: gcc-14 of the same banner builds it
    assert nv.toolchain_for("6.12.118+deb13-amd64", TRIXIE_612_CC_TEXT, TRIXIE, need_cxx=True) == {
        "cc": "gcc-14", "cxx": "g++-14", "note": None, "refusal": None}


def test_pve9_kernel_on_a_host_that_still_has_only_gcc_12_is_refused():
    """A host upgraded to 9 whose toolchain is still bookworm's: the 9.x kernel was built with
    GCC 14, and modules built with 12 are the incident-1 mismatch."""
    result = nv.toolchain_for("7.0.14-14-pve", PVE9_CC_TEXT, {"gcc": BOOKWORM_GCC, "gcc-12": BOOKWORM_GCC12})
    assert result["cc"] is None and "Install GCC 14.2.0 (apt install gcc-14)" in result["refusal"]
    # and the other way round: an 8.x kernel on a trixie toolchain
    result = nv.toolchain_for("6.14.8-2-pve", PVE_CC_TEXT, TRIXIE)
    assert result["cc"] is None and "Install GCC 12.2.0 (apt install gcc-12)" in result["refusal"]


def test_a_gxx_of_the_same_gcc_with_another_revision_is_taken():
    """G++ names itself `g++-12` in its banner: its GCC version is read like gcc's (facts.compilers
    compiler_version; before: None for any g++ banner, so a g++-12 of another Debian revision than the
    gcc-12 was refused as "not G++ 12.2.0")."""
    compilers = {"gcc-12": BOOKWORM_GCC12, "g++-12": "g++-12 (Debian 12.2.0-14) 12.2.0"}
    result = nv.toolchain_for("6.1.0-57-amd64", DEBIAN_61_CC_TEXT, compilers, need_cxx=True)
    assert (result["cc"], result["cxx"], result["refusal"]) == ("gcc-12", "g++-12", None)
    other = {"gcc-12": BOOKWORM_GCC12, "g++-12": "g++-12 (Debian 12.3.0-1) 12.3.0"}
    assert nv.toolchain_for("6.1.0-57-amd64", DEBIAN_61_CC_TEXT, other, need_cxx=True)["refusal"]
