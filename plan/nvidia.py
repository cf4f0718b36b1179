"""What the NVIDIA driver and module-options stages should do, from spec + facts (no I/O).

Stage 3 (operations/nvidia.py) builds the kernel modules (NVIDIA's open tree; the proprietary
one only with nvidia.open: false and no Blackwell GPU) for each target kernel release,
installs user space and GSP firmware of the same version; stage 5 (operations/module_options.py)
writes /etc/modprobe.d/pvegpu-nvidia.conf and the boot unit that makes /dev/nvidia-uvm*.

Guards from the field (/work/shared/INCIDENTS.md):
  1  modules built by another GCC than their kernel bricked a host -> `toolchain_for`
  2  GSP firmware of another version panicked a boot             -> `firmware_problem` (and operations.nvidia.verify_command)
  3  cuInit failed in LXC on Blackwell without uvm_disable_hmm=1  -> `uvm_disable_hmm`
  6  user space != module version -> `driver_steps` on the host; plan.containers in each GPU CT
  14 -j = cores OOM-killed a build                                -> `build_jobs`
"""

from __future__ import annotations

import re

from facts.compilers import compiler_version
from facts.nvidia import SHIM_VALIDATION_OFF
from plan.render import render_template

GIB_KIB = 1024 * 1024

# Blackwell dies by PCI device-id range (vendor 10de), from NVIDIA's published device ids:
# GB100/GB102 (B100, B200 10de:2901, GB200) 29xx; GB202 (RTX 5090 10de:2b85, RTX PRO 6000
# Blackwell 10de:2bb1 / Server Edition 10de:2bb5) 2Bxx; GB203 (RTX 5080 10de:2c02) 2Cxx;
# GB206/GB207 (RTX 5060 Ti 10de:2d04) 2Dxx; GB10 2Exx; GB205 (RTX 5070 10de:2f04) 2Fxx.
# Hopper (H100 10de:2330, H200 10de:2335) is 23xx and Ada 26xx-28xx: both outside.
BLACKWELL_DEVICE_RANGES = ((0x2900, 0x29FF), (0x2B00, 0x2FFF))
# Model names the driver prints (/proc/driver/nvidia/gpus/*/information, nvidia-smi -L).
BLACKWELL_NAME_RE = re.compile(r"Blackwell|\bG?B[123]00\b|\bRTX 50[0-9]0\b")
NVIDIA_VENDOR = "10de"
DISPLAY_CLASS_PREFIX = "03"  # 0300 VGA, 0302 3D controller


# -- targets and parallelism ---------------------------------------------------------------

def target_releases(running: str | None, kernel_stage: list[str] | None = None,
                    explicit: list[str] | None = None) -> list[str]:
    """Kernel releases the modules are built for: `explicit` when given, else the running one
    plus any the kernel stage installs (it builds before the reboot into the new kernel).

    >>> target_releases("6.8.12-4-pve", ["6.14.8-2-pve"])
    ['6.8.12-4-pve', '6.14.8-2-pve']
    """
    wanted = list(explicit) if explicit else [r for r in [running, *(kernel_stage or [])] if r]
    return list(dict.fromkeys(wanted))


def build_jobs(cores: int, mem_total_kib: int, per_job_gib: int = 2) -> int:
    """`make -j` from memory and cores: ~2 GiB per compile job, never more jobs than cores
    (incident 14: -j128 with 2 GiB per job exhausted a host)."""
    by_memory = mem_total_kib // (per_job_gib * GIB_KIB)
    return max(1, min(cores, by_memory))


# -- toolchain (incident 1) ----------------------------------------------------------------

# The toolchain rule's candidate programs, in order: the program the kernel names, gcc-<major> of
# its GCC, gcc; for C++, g++ named like the chosen gcc (suffix "-12" or ""), g++, g++-<major>. Each
# list is tried by an identical banner (less the program name) first, then by the same GCC x.y.z.
# toolchain_for fills them in for the converge; the kernel hook renders them into its shell
# (templates/nvidia-toolchain-pick.sh.j2, the `sh_pattern` filter) and decides the same way for each
# kernel apt installs, when apt installs it (a test runs both over the same cases).
CC_CANDIDATES = ("{program}", "gcc-{major}", "gcc")
CXX_CANDIDATES = ("g++{suffix}", "g++", "g++-{major}")


def _banner_tail(banner: str) -> str:
    """A `--version` first line without the program name (`gcc-12 (Debian …) 12.2.0` -> `(Debian …) 12.2.0`)."""
    return banner.strip().split(" ", 1)[1] if " " in banner.strip() else ""


def _compiler_package(program: str, version: str | None) -> str:
    if re.fullmatch(r"gcc-\d+", program):
        return program
    major = version.split(".")[0] if version else None
    return f"gcc-{major}" if major else "gcc"


def toolchain_for(release: str, cc_version_text: str | None, compilers: dict[str, str],
                  need_cxx: bool = False) -> dict:
    """Which compiler builds modules for `release`, or why none may.

    `cc_version_text` is the headers' CONFIG_CC_VERSION_TEXT (the first line of `$CC --version`
    of the compiler that built the kernel); `compilers` maps each installed gcc program to its
    `--version` first line: ``{"gcc": "gcc (Debian 12.2.0-14+deb12u1) 12.2.0", "gcc-12": …}``.

    Returns ``{"cc": "gcc-12", "cxx": "g++-12" | None, "note": str | None, "refusal": None}`` or
    ``{"cc": None, "cxx": None, "note": None, "refusal": "…which compiler to install…"}``.
    `need_cxx`: the tree compiles C++ too (NVIDIA's open tree builds src/ with $(CXX), default
    `g++`): then a g++ of the same family and x.y.z as the chosen gcc is required as well
    (`compilers` lists the g++ programs beside the gcc ones), the one named like the gcc first.
    The program the kernel named comes first, then `gcc-<major>`, then `gcc`. An identical banner (less the program
    name) is a match; the same GCC x.y.z with another distribution revision is accepted with a
    note (Debian point releases keep the ABI; Proxmox kernels are built with an older revision
    than most hosts carry); another x.y.z is refused.
    """
    result = _cc_for(release, cc_version_text, compilers)
    if result["refusal"] or not need_cxx:
        return {**result, "cxx": None}
    cc = result["cc"]
    wanted_version = compiler_version(compilers[cc]) or ""  # _cc_for found this gcc by its version
    suffix = cc[len("gcc"):]  # "-12" or ""
    names = (p.format(suffix=suffix, major=wanted_version.split(".")[0]) for p in CXX_CANDIDATES)
    candidates = [c for c in dict.fromkeys(names) if c in compilers]
    for cxx in candidates:
        if _banner_tail(compilers[cxx]) == _banner_tail(compilers[cc]):
            return {**result, "cxx": cxx}
    for cxx in candidates:
        if compiler_version(compilers[cxx]) == wanted_version:
            return {**result, "cxx": cxx}
    have = "; ".join(f"{c}: {compilers[c]!r}" for c in compilers if c.startswith("g++")) or "no g++ at all"
    package = f"g++{suffix}" if suffix else f"g++-{wanted_version.split('.')[0]}"
    return {"cc": None, "cxx": None, "note": None,
            "refusal": f"kernel {release}: NVIDIA's open tree compiles its C++ files with $(CXX), which must be "
                       f"G++ {wanted_version} like the {cc} that matches the kernel, but this host has {have}; "
                       f"a C++ compiler of another version than the kernel's left a host unbootable (incident 1). "
                       f"Install G++ {wanted_version} (apt install {package}) and run again"}


def _cc_for(release: str, cc_version_text: str | None, compilers: dict[str, str]) -> dict:
    """`toolchain_for` for $(CC) alone."""
    if not cc_version_text:
        return {"cc": None, "note": None,
                "refusal": f"kernel {release}: its headers carry no CONFIG_CC_VERSION_TEXT, so the compiler "
                           f"that built it is unknown; install its complete headers package"}
    wanted_version = compiler_version(cc_version_text)
    program = cc_version_text.split(" ", 1)[0]
    if "gcc" not in program:
        return {"cc": None, "note": None,
                "refusal": f"kernel {release} was built with {cc_version_text!r}, not GCC; "
                           f"pvegpu builds NVIDIA modules with the kernel's own GCC only"}
    # the kernel's program (Debian 6.12 names x86_64-linux-gnu-gcc-12), then gcc-<major>, then gcc:
    # every release built by one GCC gets the same program, so they share one src/ build
    major = wanted_version.split(".")[0] if wanted_version else None
    names = (p.format(program=program, major=major) for p in CC_CANDIDATES)
    candidates = [c for c in dict.fromkeys(names) if c in compilers and c.startswith("gcc")]
    for cc in candidates:
        if _banner_tail(compilers[cc]) == _banner_tail(cc_version_text):
            return {"cc": cc, "note": None, "refusal": None}
    for cc in candidates:
        if compiler_version(compilers[cc]) == wanted_version:
            return {"cc": cc, "refusal": None,
                    "note": f"kernel {release} was built with {cc_version_text!r}; using {compilers[cc]!r} "
                            f"(same GCC {wanted_version}, other distribution revision)"}
    have = "; ".join(f"{c}: {compilers[c]!r}" for c in compilers if c.startswith("gcc")) or "no gcc at all"
    package = _compiler_package(program, wanted_version)
    return {"cc": None, "note": None,
            "refusal": f"kernel {release} was built with {cc_version_text!r} but this host has {have}; "
                       f"modules built by another compiler left a host unbootable (incident 1). "
                       f"Install GCC {wanted_version} (apt install {package}) and run again"}


# -- build or skip ------------------------------------------------------------------------

def module_current(release: str, version: str, installed: dict | None) -> tuple[bool, str]:
    """Whether the nvidia module `modinfo -k <release>` finds is `version` built for `release`.

    `installed`: ``{"version": "535.309.01", "vermagic": "6.1.0-57-amd64 SMP preempt …",
    "filename": "/lib/modules/…/nvidia.ko"}`` or None.
    """
    if not installed or not installed.get("version"):
        return False, f"no nvidia module installed for {release}"
    if installed["version"] != version:
        return False, f"nvidia {installed['version']} is installed for {release}, want {version}"
    vermagic = (installed.get("vermagic") or "").split()
    if not vermagic or vermagic[0] != release:
        return False, (f"nvidia {version} for {release} has vermagic "
                       f"{installed.get('vermagic')!r}, built for another kernel")
    return True, f"nvidia {version} is installed for {release} ({installed.get('filename')})"


# -- builds that would fail late ------------------------------------------------------------

# Open trees known to emit "'naked' return found in MITIGATION_RETHUNK build" objtool warnings
# (thousands, from src/ objects NVIDIA's own Makefiles compile without the kernel's
# -mfunction-return=thunk-extern; src/nvidia/Makefile and src/nvidia-modeset/Makefile pass only
# -mindirect-branch=thunk-extern, in all 193 tags of the repository up to this one); building 595.45.04 against
# Debian's 6.12.118 headers printed 13,777 of them (2026-12-03). Newer versions are not known either way.
RETHUNK_WARNING_TREES_UP_TO = "595.45.04"


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", version))


def objtool_problem(release: str, config: dict[str, str], version: str, open_tree: bool) -> tuple[str | None, str | None]:
    """(refusal, note) for a kernel whose objtool turns warnings into errors.

    `config`: the release's auto.conf options (`CONFIG_OBJTOOL_WERROR`, `CONFIG_MITIGATION_RETHUNK`
    or its pre-6.9 name `CONFIG_RETHUNK`). With -Werror and return thunks on, an open tree of a
    version known to leave bare `ret`s in its src/ objects fails when kbuild links nvidia.ko, after
    the whole src/ compile; refused up front. A newer open tree is only noted.
    """
    werror = config.get("CONFIG_OBJTOOL_WERROR") == "y"
    rethunk = "y" in (config.get("CONFIG_MITIGATION_RETHUNK"), config.get("CONFIG_RETHUNK"))
    if not (open_tree and werror and rethunk):
        return None, None
    if _version_tuple(version) <= _version_tuple(RETHUNK_WARNING_TREES_UP_TO):
        return (f"kernel {release} has CONFIG_OBJTOOL_WERROR=y with return thunks (CONFIG_MITIGATION_RETHUNK) and "
                f"NVIDIA's open tree {version} leaves bare returns in its src/ objects: objtool's "
                f"\"'naked' return found in MITIGATION_RETHUNK build\" warnings become errors and the build would "
                f"fail at the link, after the whole compile. Build the kernel without CONFIG_OBJTOOL_WERROR "
                f"(kernel.config_fragments: ['# CONFIG_OBJTOOL_WERROR is not set']) or use a tree newer than "
                f"{RETHUNK_WARNING_TREES_UP_TO} that is known to build"), None
    return None, (f"kernel {release} has CONFIG_OBJTOOL_WERROR=y with return thunks; open trees up to "
                  f"{RETHUNK_WARNING_TREES_UP_TO} fail there, {version} is not known either way")


def enforcement_sources(secure_boot: bool | None, sig_enforce: bool | None, configs: dict[str, dict[str, str]]) -> list[str]:
    """What makes the kernel refuse an unsigned (or not trusted) module, each in words: Secure Boot
    (lockdown), module.sig_enforce=Y (/sys/module/module/parameters/sig_enforce), and per target
    release CONFIG_MODULE_SIG_FORCE=y (kernel/module/signing.c module_sig_check(): any of them makes
    a bad or missing signature a refusal, not a taint)."""
    sources = []
    if secure_boot:
        sources.append("Secure Boot is on")
    if sig_enforce:
        sources.append("module.sig_enforce is Y")
    forced = sorted(r for r, config in configs.items() if config.get("CONFIG_MODULE_SIG_FORCE") == "y")
    if forced:
        sources.append(f"kernel {', '.join(forced)} has CONFIG_MODULE_SIG_FORCE=y")
    return sources


MOK_WORDS = {
    "not enrolled": "is not enrolled as a machine owner key (mokutil --test-key)",
    "pending": "is imported but not enrolled: its MokManager confirmation at boot was never done",
    "blocked": "is blocked (listed in dbx or MokListX)",
}


def signing_key_refusal(field: str, path: str, owner_mode: dict | None) -> str | None:
    """Why a Secure Boot signing key cannot be used, naming the field and file; None when it is
    root's and no group or other may read or write it, or when its owner and mode are unknown.
    Issue 39 item 4: the key lies unencrypted on the host (the kernel hook signs without anyone
    typing a passphrase), so whoever can read it signs kernels and modules the firmware trusts.
    The same rule runs where the key is used: templates/signing-key-check.sh.j2."""
    if owner_mode is None:
        return None
    uid, mode = owner_mode["uid"], owner_mode["mode"]
    if uid == 0 and not mode & 0o077:
        return None
    return (f"{field} {path} is owner uid {uid}, mode {mode:04o}: a signing key must be root's and readable by root "
            f"only, else any local account can sign kernels and modules Secure Boot trusts. Fix it on the host "
            f"(chown root:root {path}; chmod 600 {path}) and run again")


def signing_problems(state: dict, signing, releases: list[str]) -> tuple[list[str], list[str]]:
    """(refusals, notes) about module signatures for the `releases` built this run.

    `state`: the NvidiaHostState fact (secure_boot, sig_enforce, signing_files, signing_key_pem,
    mok, releases[r].config); `signing`: the spec's nvidia.signing (``.key``, ``.cert``) or None.
    Refused: enforcement on and no signing; a key or cert that is not readable; a key that is not
    root's alone (signing_key_refusal); a key that is not PEM (sign-file reads PEM only: the build would fail after the whole compile); a cert the
    kernel will not trust (not enrolled, enrolment pending, blocked) while enforcement is on (the
    modules would not load: "Key was rejected by service"). Unknown states are said as such.
    """
    configs = {r: ((state.get("releases") or {}).get(r) or {}).get("config") or {} for r in releases}
    secure_boot = state.get("secure_boot")
    sources = enforcement_sources(secure_boot, state.get("sig_enforce"), configs)
    refusals: list[str] = []
    notes: list[str] = []
    if state.get("secure_boot_state") == SHIM_VALIDATION_OFF:
        # the kernel's efi_get_secureboot: MokSBState 1 turns Secure Boot off for the kernel (no lockdown)
        notes.append("Secure Boot is enabled in the firmware but validation disabled in shim (MokSBState): the kernel "
                     "does not enforce signatures, so unsigned NVIDIA modules load; turning shim's validation back on "
                     "(mokutil --enable-validation) makes them refuse to load unless nvidia.signing signs them")
    if signing is None:
        if sources:
            refusals.append(f"{'; '.join(sources)}: the kernel would refuse the unsigned NVIDIA modules, and "
                            f"nvidia.signing is not set. Enroll a machine owner key (mokutil --import cert.der, "
                            f"confirmed in MokManager at the next boot) and set nvidia.signing.key (PEM) and .cert "
                            f"to it" + (", or turn Secure Boot off" if secure_boot else ""))
        elif secure_boot is None:
            notes.append("Secure Boot state unknown (no mokutil answer, EFI variables not readable): if it is on, "
                         "the unsigned modules will not load")
        return refusals, notes
    files = state.get("signing_files") or {}
    missing = [path for path in (signing.key, signing.cert) if not files.get(path)]
    if missing:
        refusals.append(f"nvidia.signing names {', '.join(missing)}, which {'is' if len(missing) == 1 else 'are'} "
                        f"not readable on the host; give the PEM private key and the certificate that sign the modules")
        return refusals, notes
    key_refusal = signing_key_refusal("nvidia.signing.key", signing.key, state.get("signing_key_mode"))
    if key_refusal:
        refusals.append(key_refusal)
    if state.get("signing_key_pem") is False:
        refusals.append(f"nvidia.signing.key {signing.key} is not a PEM private key; the kernel's scripts/sign-file "
                        f"reads the key as PEM only, so signing would fail after the whole build. Convert it "
                        f"(openssl pkey -inform DER -in KEY -out KEY.pem) and name the PEM file")
    mok = state.get("mok")
    if mok in MOK_WORDS:
        message = (f"nvidia.signing.cert {signing.cert} {MOK_WORDS[mok]}; the kernel would refuse modules signed "
                   f"with it ('Key was rejected by service')")
        if sources:
            refusals.append(f"{message} because {'; '.join(sources)}. Enroll it (mokutil --import, then confirm "
                            f"in MokManager at the next boot) and run again")
        else:
            notes.append(f"{message} once signatures are enforced; nothing enforces them now")
    elif mok == "in db":
        notes.append(f"nvidia.signing.cert {signing.cert} is in the firmware's db, not the MOK list; kernels "
                     f"that verify modules only against built-in and machine-owner keys will not trust it")
    elif mok == "not DER":
        notes.append(f"nvidia.signing.cert {signing.cert} is not a DER certificate, so mokutil cannot say whether "
                     f"it is enrolled (enrolment unknown); give the DER form (openssl x509 -outform DER)")
    elif mok is None:
        notes.append(f"enrolment of nvidia.signing.cert {signing.cert} unknown (mokutil not installed); if it is "
                     f"not enrolled, the signed modules will not load while signatures are enforced")
    return refusals, notes


# -- versions of modules, firmware and user space (incidents 2, 6) -------------------------

# GSP firmware file per GPU family, by PCI device-id range (vendor 10de); follows the open
# tree's kernel-open/common/inc/nv-firmware.h nv_firmware_for_chip_family(): Turing (TU10x,
# TU11x) and GA100 load gsp_tu10x.bin; GA10x, Ada (AD10x), Hopper (GH100) and Blackwell
# (GB10x/GB20x) load gsp_ga10x.bin. Older GPUs have no GSP (the open modules do not drive them).
GSP_FIRMWARE_RANGES = (
    ((0x1E00, 0x1FFF), "Turing", "gsp_tu10x.bin"),
    ((0x2180, 0x21FF), "Turing", "gsp_tu10x.bin"),    # TU116/TU117
    ((0x20B0, 0x20FF), "Ampere GA100", "gsp_tu10x.bin"),
    ((0x2200, 0x22FF), "Ampere GA10x", "gsp_ga10x.bin"),
    ((0x2300, 0x233F), "Hopper", "gsp_ga10x.bin"),
    ((0x2340, 0x25FF), "Ampere GA10x", "gsp_ga10x.bin"),
    ((0x2600, 0x28FF), "Ada", "gsp_ga10x.bin"),
    ((0x2900, 0x29FF), "Blackwell", "gsp_ga10x.bin"),
    ((0x2B00, 0x2FFF), "Blackwell", "gsp_ga10x.bin"),
)


def gsp_firmware_for(device_id: str | None) -> tuple[str, str] | None:
    """(GPU generation, GSP firmware file it loads) for a PCI device id ("2bb5" -> ("Blackwell",
    "gsp_ga10x.bin")), None for an unknown id or a GPU without GSP."""
    try:
        value = int(device_id or "", 16)
    except ValueError:
        return None
    for (lo, hi), generation, name in GSP_FIRMWARE_RANGES:
        if lo <= value <= hi:
            return generation, name
    return None


def needed_gsp_firmware(gpu_ids: dict[str, str]) -> dict[str, list[str]]:
    """GSP firmware file -> "<generation> <bdf>" of each GPU that loads it (GPUs of unknown id left out).

    >>> needed_gsp_firmware({"0000:01:00.0": "2bb5", "0000:41:00.0": "1eb8"})
    {'gsp_ga10x.bin': ['Blackwell 0000:01:00.0'], 'gsp_tu10x.bin': ['Turing 0000:41:00.0']}
    """
    needed: dict[str, list[str]] = {}
    for bdf, device in sorted(gpu_ids.items()):
        found = gsp_firmware_for(device)
        if found:
            needed.setdefault(found[1], []).append(f"{found[0]} {bdf}")
    return dict(sorted(needed.items()))


def missing_gsp_firmware(version: str, firmware: dict[str, list[str]], needed: dict[str, list[str]]) -> dict[str, list[str]]:
    """The `needed` files that /lib/firmware/nvidia/<version>/ lacks; with nothing known to be
    needed, any gsp*.bin of the version will do (an empty dict when one is there)."""
    present = set(firmware.get(version) or [])
    if not needed:
        return {} if present else {"gsp_*.bin": []}
    return {name: gpus for name, gpus in needed.items() if name not in present}


def firmware_problem(version: str, firmware: dict[str, list[str]], want_firmware: bool,
                     installer_configured: bool, needed: dict[str, list[str]] | None = None) -> str | None:
    """Refusal when GSP firmware of exactly `version` is needed, absent, and nothing will bring it.

    `firmware`: version directory under /lib/firmware/nvidia -> its gsp*.bin files,
    e.g. ``{"535.261.03": ["gsp_ga10x.bin", "gsp_tu10x.bin"]}``; `needed`: `needed_gsp_firmware`
    of the host's GPUs (each file of exactly `version` must be there; without it any gsp*.bin).
    """
    missing = missing_gsp_firmware(version, firmware, needed or {})
    if not want_firmware or not missing or installer_configured:
        return None
    others = sorted(v for v, files in firmware.items() if files and v != version)
    found = f"found GSP firmware only for {', '.join(others)}" if others else "found no GSP firmware"
    which = "; ".join(f"{name} for {', '.join(gpus)}" for name, gpus in missing.items() if gpus)
    return (f"GSP firmware for {version} is missing under /lib/firmware/nvidia/{version}/ "
            f"({which + '; ' if which else ''}{found}); "
            f"modules of one version with firmware of another panicked a boot (incident 2). "
            f"Configure nvidia.installer (the .run carries the firmware) or install firmware {version}")


# -- module options (incident 3) -----------------------------------------------------------

def is_blackwell(device_id: str | None = None, model: str | None = None) -> bool:
    """A Blackwell GPU, by PCI device id (hex, e.g. "2bb5") or by the model name the driver prints."""
    if model and BLACKWELL_NAME_RE.search(model):
        return True
    if device_id:
        try:
            value = int(device_id, 16)
        except ValueError:
            return False
        return any(lo <= value <= hi for lo, hi in BLACKWELL_DEVICE_RANGES)
    return False


def nvidia_gpu_ids(pci_devices: dict[str, dict]) -> dict[str, str]:
    """BDF -> device id of every NVIDIA display-class function (GPUs, not their audio)."""
    return {bdf: dev.get("device") or "" for bdf, dev in sorted(pci_devices.items())
            if dev.get("vendor") == NVIDIA_VENDOR and str(dev.get("class") or "").startswith(DISPLAY_CLASS_PREFIX)}


def uvm_disable_hmm(setting: bool | str, gpu_ids: dict[str, str], models: dict[str, str] | None = None) -> tuple[bool, str]:
    """Whether to set `nvidia_uvm uvm_disable_hmm=1`, and why.

    `setting` is the spec's True/False/"auto"; auto turns it on when any GPU is Blackwell
    (by device id in `gpu_ids` {bdf: "2bb5"} or by model name in `models` {bdf: "NVIDIA …"}).
    """
    if setting is True:
        return True, "spec sets nvidia.uvm_disable_hmm: true"
    if setting is False:
        return False, "spec sets nvidia.uvm_disable_hmm: false"
    models = models or {}
    blackwell = sorted(bdf for bdf in set(gpu_ids) | set(models)
                       if is_blackwell(gpu_ids.get(bdf), models.get(bdf)))
    if blackwell:
        return True, (f"auto: Blackwell GPU(s) {', '.join(blackwell)}; CUDA init failed in LXC on "
                      f"Blackwell with HMM on (incident 3)")
    return False, "auto: no Blackwell GPU found"


def open_modules_problem(open_modules: bool, gpu_ids: dict[str, str], models: dict[str, str] | None = None) -> str | None:
    """Refusal when the spec builds NVIDIA's proprietary kernel modules for a host with Blackwell GPUs.

    Blackwell is supported by the open kernel modules only; on older GPUs `open: false` builds
    whatever tree `modules_source` holds (CI builds only the open tree; this branch has unit tests).
    """
    if open_modules:
        return None
    models = models or {}
    blackwell = sorted(bdf for bdf in set(gpu_ids) | set(models) if is_blackwell(gpu_ids.get(bdf), models.get(bdf)))
    if not blackwell:
        return None
    return (f"nvidia.open is false but GPU(s) {', '.join(blackwell)} are Blackwell, which only NVIDIA's open "
            f"kernel modules drive; set nvidia.open: true and give the open-gpu-kernel-modules archive")


MODPROBE_SAFE_RE = re.compile(r"^[A-Za-z0-9_.,:;=+/@%-]*$")


def modprobe_value(value: int | bool | str) -> str:
    """One option value as modprobe.d reads it: bare when safe, else in double quotes.

    kmod splits options at whitespace outside double quotes and has no escape for `"` itself,
    so a value containing `"` or a backslash is refused (ValueError) rather than mangled.
    """
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int):
        return str(value)
    text = str(value)
    if '"' in text or "\\" in text or "\n" in text or "\r" in text or "\x00" in text:
        raise ValueError(f"{text!r}: a modprobe option value cannot hold a double quote, backslash or newline")
    return text if text and MODPROBE_SAFE_RE.match(text) else f'"{text}"'


def modprobe_options(disable_hmm: bool, nvreg: dict[str, int | str]) -> dict[str, list[str]]:
    """module -> ["key=value", …] for /etc/modprobe.d/pvegpu-nvidia.conf (sorted, stable)."""
    options: dict[str, list[str]] = {}
    if nvreg:
        options["nvidia"] = [f"{key}={modprobe_value(nvreg[key])}" for key in sorted(nvreg)]
    if disable_hmm:
        options["nvidia_uvm"] = ["uvm_disable_hmm=1"]
    return options


def render_modprobe_conf(disable_hmm: bool, hmm_reason: str, nvreg: dict[str, int | str]) -> str:
    """The text of /etc/modprobe.d/pvegpu-nvidia.conf."""
    return render_template("modprobe-nvidia.conf.j2", options=modprobe_options(disable_hmm, nvreg),
                           hmm_reason=hmm_reason)


def render_nodes_unit() -> str:
    """The text of /etc/systemd/system/pvegpu-nvidia-nodes.service (incident 5)."""
    return render_template("nvidia-device-nodes.service.j2")


# -- the driver stage's steps --------------------------------------------------------------

def userspace_versions(paths: list[str]) -> list[str]:
    """Versions of the NVML libraries found: `/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.535.309.01` -> `535.309.01`."""
    found = []
    for path in paths:
        match = re.search(r"libnvidia-ml\.so\.(\d+\.\d+(?:\.\d+)?)$", path.strip())
        if match and match.group(1) not in found:
            found.append(match.group(1))
    return sorted(found)


def source_mismatch(what: str, source, checked: dict | None) -> str | None:
    """Refusal when a local source (path or file://) does not have the spec's sha256.

    `source` has `.url` and `.sha256` (spec.models.SourceSpec); `checked` is the fact's entry
    ``{"cached": False, "sha256": "…"}`` (sha256 None: remote URL, checked after download).
    """
    if not source or not checked or checked.get("cached") or not checked.get("sha256"):
        return None
    if checked["sha256"] == source.sha256:
        return None
    return (f"{what} {source.url} has sha256 {checked['sha256']} but the spec says {source.sha256}; "
            f"refusing to build or install from it (nothing was changed)")


def reboot_reason(version: str, loaded: str | None, running: str | None, steps: dict, state: dict) -> str | None:
    """Why the host must reboot after this run, or None: the loaded nvidia module (`loaded`, from
    /proc/driver/nvidia/version) is another version than the one the running kernel has (or gets
    this run) on disk. Until the old module is unloaded, nvidia-smi and CUDA fail with
    "Driver/library version mismatch" against the new user space on the host and in every
    container; a reboot loads the installed one. No module loaded (a first install) is no reason.
    """
    if not loaded or loaded == version or not running:
        return None
    entry = (steps.get("releases") or {}).get(running) or {}
    module = ((state.get("releases") or {}).get(running) or {}).get("module") or {}
    if not (entry.get("build") or module.get("version") == version):
        return None
    return (f"nvidia {loaded} is loaded but {version} is installed for {running}; nvidia-smi and CUDA "
            f"fail with 'Driver/library version mismatch' until the new module is loaded")


def driver_steps(version: str, releases: list[str], state: dict, *, modules_source=None,
                 installer=None, want_firmware: bool = True, required: set[str] | None = None,
                 open_tree: bool = False, signing=None, gpu_ids: dict[str, str] | None = None) -> dict:
    """Everything the driver stage will do, decided from the host state before any change.

    `modules_source`/`installer` are the spec's SourceSpec (or None).
    `state` is the `NvidiaHostState` fact (see facts/nvidia.py for its shape); `releases`
    the target kernel releases; `required` the releases whose missing headers are a refusal
    (default: all; a release the kernel stage has not installed yet is only noted);
    `open_tree`: the source is NVIDIA's open tree (C++ in src/: a matching g++ is needed; objtool
    -Werror kernels are weighed); `signing`: the spec's nvidia.signing or None (Secure Boot);
    `gpu_ids`: {bdf: PCI device id} of the host's NVIDIA GPUs (which GSP firmware files they load).
    GSP firmware has one source, the installer: `.run --no-kernel-modules` installs it beside the
    user space, so a missing firmware file of the version reruns the installer.

    .. code:: python

        {"jobs": 2, "ccache": True,
         "releases": {"6.1.0-57-amd64": {"build": True, "reason": "no nvidia module installed …",
                                         "cc": "gcc-12", "headers": True}},
         "fetch_modules": True, "fetch_installer": False, "install_userspace": False,
         "firmware_files": ["gsp_ga10x.bin"], "verify": True,
         "refusals": [], "notes": ["…"]}
    """
    required = set(releases) if required is None else required
    refusals: list[str] = []
    notes: list[str] = []
    per_release: dict[str, dict] = {}
    for release in releases:
        info = state["releases"].get(release) or {}
        current, reason = module_current(release, version, info.get("module"))
        entry = {"build": False, "reason": reason, "cc": None, "cxx": None, "headers": bool(info.get("headers"))}
        per_release[release] = entry
        if current:
            continue
        if not info.get("headers"):
            message = (f"kernel {release}: no headers at /lib/modules/{release}/build to build nvidia {version} "
                       f"against; install them (proxmox-headers-{release} on Proxmox, linux-headers-{release} on Debian)")
            (refusals if release in required else notes).append(
                message if release in required else message + "; skipped until they are there")
            continue
        toolchain = toolchain_for(release, info.get("cc_version_text"), state.get("compilers") or {},
                                  need_cxx=open_tree)
        if toolchain["refusal"]:
            refusals.append(toolchain["refusal"])
            continue
        refusal, note = objtool_problem(release, info.get("config") or {}, version, open_tree)
        if note:
            notes.append(note)
        if refusal:
            refusals.append(refusal)
            continue
        if signing is not None and not info.get("sign_file"):
            refusals.append(f"kernel {release}: its headers have no scripts/sign-file to sign the modules with "
                            f"(nvidia.signing is set); install its complete headers package")
            continue
        if toolchain["note"]:
            notes.append(toolchain["note"])
        if modules_source is None:
            refusals.append(f"kernel {release}: {reason}, and nvidia.modules_source is not set; give the "
                            f"open-gpu-kernel-modules archive (url + sha256) to build from")
            continue
        # sign with the hash the kernel signs its own modules with (Proxmox: sha512)
        entry.update(build=True, cc=toolchain["cc"], cxx=toolchain["cxx"],
                     sig_hash=(info.get("config") or {}).get("CONFIG_MODULE_SIG_HASH") or "sha256")

    built = [r for r, e in per_release.items() if e["build"]]
    if built:
        sign_refusals, sign_notes = signing_problems(state, signing, built)
        refusals += sign_refusals
        notes += sign_notes
    have_userspace = userspace_versions(state.get("userspace") or [])
    installer_given = installer is not None
    firmware = state.get("firmware") or {}
    needed_firmware = needed_gsp_firmware(gpu_ids or {})
    firmware_missing = bool(want_firmware and missing_gsp_firmware(version, firmware, needed_firmware))
    install_userspace = installer_given and (have_userspace != [version] or firmware_missing)
    if not installer_given and any(v != version for v in have_userspace):
        refusals.append(f"user space {', '.join(have_userspace)} is installed but the modules are {version}; "
                        f"containers and tools fail with 'driver/library version mismatch' (incident 6). "
                        f"Configure nvidia.installer to install user space {version}")
    if not installer_given and not have_userspace:
        notes.append(f"no NVIDIA user space found; set nvidia.installer to install {version}'s")

    problem = firmware_problem(version, firmware, want_firmware, installer_given, needed_firmware)
    if problem:
        refusals.append(problem)

    builds = any(e["build"] for e in per_release.values())
    sources = state.get("sources") or {}
    fetch_modules = modules_source is not None and builds
    fetch_installer = install_userspace
    for what, key, source, used in (("modules source", "modules", modules_source, fetch_modules),
                                    ("installer", "installer", installer, fetch_installer)):
        mismatch = source_mismatch(what, source, sources.get(key)) if used else None
        if mismatch:
            refusals.append(mismatch)
    changes = builds or install_userspace
    return {
        "jobs": build_jobs(state.get("cores") or 1, state.get("mem_total_kib") or 0),
        "ccache": bool(state.get("ccache")),
        "releases": per_release,
        "fetch_modules": fetch_modules,
        "fetch_installer": fetch_installer,
        "install_userspace": install_userspace,
        "firmware_files": sorted(needed_firmware) if want_firmware else [],
        "verify": changes,
        "refusals": refusals,
        "notes": notes,
    }
