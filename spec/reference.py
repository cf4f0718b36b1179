"""The spec reference: one entry per field of `spec/models.py`, and the page made from it.

    python -m spec.reference            # writes docs/reference/spec.md (also: make docs-ref)
    python -m spec.reference --check    # exit 1 when the committed page differs

Type and default come from the models (and `group_data/all.py`, merged under each host);
what a field means, the rule its value must pass and an example come from `FIELDS` below,
the one place they are written. tests/unit/test_spec_reference.py fails when a field of the
models has no entry, an entry names no field, or the committed page is not what this writes.
"""

from __future__ import annotations

import sys
import types
import typing
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from group_data.all import PVEGPU_DEFAULTS
from spec.models import HostSpec

PAGE = Path(__file__).resolve().parent.parent / "docs" / "reference" / "spec.md"


@dataclass(frozen=True)
class Field:
    meaning: str
    rule: str
    example: str = ""


_BOOL = "`true` or `false`."
_HOST = ("A DNS name (RFC 1123 labels, ≤ 253) or an IP address written bare; an IPv6 zone id is an interface "
         "name (1–15 of letters, digits, `_.-`: `fe80::1%vmbr0`); no brackets, port, `@`, `/` or `#` (the URL "
         "proxmoxer builds has exactly this host).")
_LOCAL_PATH = "A non-empty path on the machine that runs pyinfra (`~` allowed)."
_HOST_PATH = ("An absolute path on the host, without `.`/`..`/`//`, ≤ 4095; `key` and `cert` both or neither "
              "(the mapping is one value).")
_SOURCE_URL = ("`https://`/`http://` URL, `file:///abs/path` or `/abs/path`; its last part ≤ 185 characters (kept as "
               "`<sha256>-<part>.part`, one 255-byte file name). A URL is parsed and must read back as written: host "
               "checked as `ssh.hostname` (IPv6 in brackets, no zone id), no password, no `#`, path of RFC 3986 "
               "characters, ≤ 2048.")
_NVIDIA_SHA = ("64 lowercase hex characters, not a placeholder (all zeros, a repeated pattern, the empty file's).")
_SECONDS = "1–3600 (seconds)."
_NCCL = ("`NCCL_*` keys; values one line, no surrounding spaces or quotes, a level NCCL knows for `NCCL_P2P_LEVEL`, "
         "`NCCL_SHM_LEVEL` and `NCCL_NET_GDR_LEVEL`, ≤ 1023 bytes (NCCL keeps no more of a line of `nccl.conf`); "
         "level names are checked as NCCL reads them (case-sensitive).")
_RELEASE = "A kernel release like `6.14.11-4-pve` (starts with a digit; letters, digits, `.+~-`), ≤ 64 characters (`uname -r`)."

# field path (a mapping's values and a list's items written `[]`) -> what it means, its rule, an example
FIELDS: dict[str, Field] = {
    "ssh.hostname": Field("Where pyinfra connects.", _HOST, "`kpro6.lab.internal`"),
    "ssh.port": Field("SSH port.", "1–65535 (`true`/`false` are not numbers).", "`22`"),
    "ssh.user": Field("SSH login.", "A login name (`[a-z_][a-z0-9_-]*`, ≤ 32, as useradd takes it).", "`root`"),
    "ssh.key": Field("Private key pyinfra uses.", _LOCAL_PATH, "`~/.ssh/id_ed25519`"),
    "node": Field("Proxmox node name (mappings, API paths); refused when it is not the host's (`uname -n` without "
                  "the domain). Unset: the host's.",
                  "A Proxmox node name: letters, digits, `-` not at either end, ≤ 63 (pve-common "
                  "`pve_verify_node_name`).", "`kpro6`"),
    "boot_loader": Field("Boot loader; `auto` detects it, and a spec that disagrees with the host is refused.",
                         "`auto`, `grub` or `systemd-boot`.", "`auto`"),
    "iommu.vendor": Field("`auto` (from CPU facts), `amd` (`amd_iommu=on`) or `intel` (`intel_iommu=on`).",
                          "`auto`, `amd` or `intel`.", "`amd`"),
    "iommu.passthrough": Field("Add `iommu=pt`; refused at preflight on SEV-SNP hosts (SNP needs the IOMMU "
                               "translating).", _BOOL, "`false`"),
    "iommu.params": Field("Extra kernel command-line parameters, one word each.",
                          "Each a word of letters, digits and `_.,:=+/@%~^-` starting with a letter, digit or `_` "
                          "(GRUB's script lexer splits or expands `;&|<>$'\"\\{}` and `#` at a word's start; the "
                          "kernel stops at a lone `--` and hands `-…` words to init); 2047 characters in all.",
                          "`[pci=realloc]`"),
    "iommu.acs_override": Field("`pcie_acs_override=<value>` on the command line.",
                                "`downstream`, `multifunction`, `id:vvvv:dddd` (≤ 15 ids), comma-separated.",
                                "`downstream,multifunction`"),
    "kernel.version": Field("The release the kernel build produces. For `proxmox-git` exactly what our build of the "
                            "pinned ref's `Makefile` produces (`KVNAME` with `-pvegpu` added to `KREL_EXTRA`), "
                            "else refused at preflight.",
                            _RELEASE + " For `proxmox-git` with `proxmox_ve` set, a release of the other Proxmox VE major is refused "
                            "(9: 6.14 or newer without `-bpo12`, not 6.14.0-1/6.14.0-2/6.14.4-1; 8: the others); at "
                            "preflight, one of another major than the host's Debian release.",
                            "`6.14.11-9-bpo12-pvegpu-pve`"),
    "kernel.source.kind": Field("`proxmox-git` (the pve-kernel repository at a pinned `ref`) or `tarball`.",
                                "`proxmox-git` or `tarball`.", "`proxmox-git`"),
    "kernel.source.url": Field("Where the kernel source comes from.",
                               "`proxmox-git`: an `https://`, `http://`, `git://` or `ssh://` URL, or a local "
                               "repository `/abs/path` / `file:///abs/path`; `tarball`: as `nvidia.installer.url`. "
                               "Parsed and read back as written (as `nvidia.installer.url`).",
                               "`git://git.proxmox.com/git/pve-kernel.git`"),
    "kernel.source.ref": Field("The commit built; required for `proxmox-git`. The build stops unless "
                               "`git rev-parse HEAD` after the checkout is this id.",
                               "A full commit id (40 or 64 lowercase hex); tags, branches and abbreviated ids are "
                               "refused (pin the commit a tag names: `git ls-remote URL 'refs/tags/TAG^{}'`).", "`ad58d1445425ea4742e3470b2edbee35df0657e9`"),
    "kernel.source.sha256": Field("Checksum of a `tarball` source (required for it).",
                                  "64 lowercase hex characters.", ""),
    "kernel.config_fragments": Field("Config lines added to the base config.",
                                     "Each `CONFIG_NAME=<y|m|n|number|0x…|\"string\">` or `# CONFIG_NAME is not set`.",
                                     "`[CONFIG_DEBUG_INFO_BTF=n]`"),
    "kernel.base_config": Field("The config the build starts from: `running` (`/boot/config-$(uname -r)`), a make "
                                "target or a config file on the host.",
                                "`running`, `tinyconfig`, `defconfig`, `allnoconfig` or an absolute host path "
                                "(no `.`/`..`/`//`, ≤ 4095).", "`running`"),
    "kernel.jobs": Field("Parallel compile jobs; `auto` = min(cores, RAM / 2 GiB).", "`auto` or 1–4096.", "`auto`"),
    "kernel.ccache": Field("Build through ccache.", _BOOL, "`true`"),
    "kernel.trial_boot": Field("Boot the new kernel once (the loader's one-shot) before it becomes the default; "
                               "`false`: installed only, the running kernel stays the default (boot the new one "
                               "from the console, the next run makes it the default).",
                               _BOOL, "`true`"),
    "kernel.trial_panic_s": Field("`panic=` of the trial boot: seconds before a panicking trial kernel resets.",
                                  _SECONDS, "`10`"),
    "kernel.remove_old": Field("Purge other releases' kernel packages (never the running or default kernel).",
                               _BOOL, "`false`"),
    "kernel.share_builder": Field("In a run of several hosts, this host builds the kernel's .debs for the others whose "
                                  "build inputs are the same (before the one with the most cores, then memory, then "
                                  "name; the first by name where several say so); the others copy, verify and install "
                                  "its build (each trial-boots it itself).", _BOOL, "`false`"),
    "kernel.signing.key": Field("With Secure Boot on: the PEM key the kernel image is signed with (`sbsign`); "
                                "unset or not enrolled is refused; the key must be root's with no group/other bits (refused at preflight "
                                "and by the sign script).", _HOST_PATH, "`/root/mok/MOK.priv`"),
    "kernel.signing.cert": Field("The DER certificate of that key, enrolled with `mokutil --import`.", _HOST_PATH,
                                 "`/root/mok/MOK.der`"),
    "kernel_updates": Field("How Proxmox kernels move between runs: `follow` (apt installs them; the kernel hook "
                            "builds the NVIDIA modules for each, else keeps the last kernel with modules the "
                            "default) or `hold` (the kernel meta-packages held at `kernel.version`'s series, else "
                            "the running kernel's).", "`follow` or `hold`.", "`follow`"),
    "nvidia.version": Field("Driver version: modules = firmware = user space.",
                            "An NVIDIA driver version, `NNN.N[NN][.N[NN]]`.", "`595.71.05`"),
    "nvidia.open": Field("Open GPU kernel modules (C and C++: g++ of the kernel's GCC needed); `false` builds the "
                         "proprietary tree `modules_source` holds (refused when a GPU is Blackwell).", _BOOL, "`true`"),
    "nvidia.modules_source.url": Field("NVIDIA's tag archive of `nvidia.version` (open-gpu-kernel-modules).",
                                       _SOURCE_URL, "`https://github.com/NVIDIA/open-gpu-kernel-modules/archive/"
                                       "refs/tags/595.71.05.tar.gz`"),
    "nvidia.modules_source.sha256": Field("Its sha256, checked before use.", _NVIDIA_SHA, ""),
    "nvidia.installer.url": Field("The `.run` of the same version (user space and GSP firmware).", _SOURCE_URL,
                                  "`https://download.nvidia.com/XFree86/Linux-x86_64/595.71.05/"
                                  "NVIDIA-Linux-x86_64-595.71.05.run`"),
    "nvidia.installer.sha256": Field("Its sha256, checked before use.", _NVIDIA_SHA, ""),
    "nvidia.firmware": Field("Check the GSP firmware of exactly this version, each file the host's GPUs load (it "
                             "comes with `nvidia.installer`).", _BOOL, "`true`"),
    "nvidia.uvm_disable_hmm": Field("`nvidia_uvm` `uvm_disable_hmm`; `auto`: on for Blackwell.",
                                    "`auto`, `true` or `false`.", "`auto`"),
    "nvidia.nvreg": Field("`NVreg_*` module options.",
                          "`NVreg_*` keys; values 32-bit numbers or strings without `\"`, `\\` or whitespace (≤ 1024).",
                          "`{NVreg_EnableGpuFirmware: 1}`"),
    "nvidia.persistenced": Field("Enable nvidia-persistenced.", _BOOL, "`true`"),
    "nvidia.share_builder": Field("In a run of several hosts, this host builds the modules for the others whose build "
                                  "inputs are the same (before the one with the most cores, then memory, then name; "
                                  "the first by name where several say so); the others copy, verify and install its "
                                  "build.", _BOOL, "`false`"),
    "nvidia.signing.key": Field("Key the modules are signed with (the kernel's `scripts/sign-file`); required when "
                                "signatures are enforced (Secure Boot on); it must be root's with no group/other bits (refused at "
                                "preflight and by the build, sign and hook scripts).", _HOST_PATH, "`/root/mok/MOK.priv`"),
    "nvidia.signing.cert": Field("Its certificate, enrolled as a MOK.", _HOST_PATH, "`/root/mok/MOK.der`"),
    "nvidia.releases": Field("Kernel releases to build the modules for; unset: the running one plus the kernel "
                             "stage's.", "Each as `kernel.version`; not empty.", "`[6.14.8-2-pve]`"),
    "gpus[].role": Field("What the GPU at this PCI address is for: `lxc` (host driver, into containers), "
                         "`vm:<vmid>` (vfio-pci passthrough), `host`, `unused`. Keys are PCI addresses; a string "
                         "value is shorthand for `{role: …}`.",
                         "Keys `dddd:bb:ss.f` in lowercase hex. `lxc`, `vm:<vmid>`, `host` or `unused`; a "
                         "`vm:<vmid>` GPU is listed under that VM's `gpus`.", "`\"0000:01:00.0\": lxc`"),
    "gpus[].unused_driver": Field("For `unused`: bind to `vfio-pci` or leave unbound.", "`vfio-pci` or `none`.",
                                  "`vfio-pci`"),
    "containers[].gpus": Field("GPUs (role `lxc`) given to the container. Keys of `containers` are guest IDs.",
                               "PCI addresses declared under `gpus` with role `lxc`, each in at most one container. "
                               "Guest IDs are 100–999999999 and unique across containers and VMs.",
                               "`[\"0000:01:00.0\"]`"),
    "containers[].nccl": Field("NCCL overrides for this container.", _NCCL, "`{NCCL_DEBUG: INFO}`"),
    "containers[].userspace_driver": Field("`true`: install the host's exact driver user space in the CT from "
                                           "`nvidia.installer`; `false`: the CT brings its own; unset: install when "
                                           "`nvidia.installer` is set.",
                                           "`true`, `false` or unset; `true` needs `nvidia.installer`.", "`true`"),
    "containers[].gid": Field("Group of the device nodes in the CT.", "0–65535.", "`44`"),
    "containers[].extra_devices": Field("Device nodes beyond what CUDA needs (`/dev/nvidiaN` of its GPUs, "
                                        "`/dev/nvidiactl`, `/dev/nvidia-uvm`): `uvm-tools` for profilers/debuggers, "
                                        "`mig-config`, `mig-monitor` for MIG management.",
                                        "A list of `uvm-tools`, `mig-config`, `mig-monitor`, each at most once, only "
                                        "with `gpus`; the MIG ones are left out (with a warning) for an unprivileged CT "
                                        "or when the cap node does not exist on the host.", "`[uvm-tools]`"),
    "vms[].gpus": Field("GPUs (role `vm:<vmid>`) passed through to the VM. Keys of `vms` are guest IDs.",
                        "PCI addresses declared under `gpus` with role `vm:<that vmid>`, at most 16 (qemu-server's "
                        "hostpci0–15).", "`[\"0000:81:00.0\"]`"),
    "vms[].machine": Field("Machine type.", "`q35` or `i440fx`.", "`q35`"),
    "vms[].allow_machine_change": Field("Opt in to switching an i440fx VM to q35 (for `pcie=1`).", _BOOL, "`false`"),
    "vms[].pool": Field("GPU pool: the cluster-wide PCI mapping the VM's GPUs join and its `hostpciN` lines "
                        "reference ([cluster](../howto/add-node.md)). Unset: per-node mappings.",
                        "A Proxmox mapping id (a letter, then letters, digits, `_`, `-`; ≥ 2 characters; pve-common "
                        "`CONFIGID_RE`), not starting with `pvegpu-` (pvegpu's per-node mappings).", "`rtx6000`"),
    "nccl.profile": Field("`auto`: NCCL variables from the topology's risks; `none`: only overrides.",
                          "`auto` or `none`.", "`auto`"),
    "nccl.overrides": Field("`NCCL_*` values that win over the rules (marked `[override]`).", _NCCL,
                            "`{NCCL_DEBUG: WARN}`"),
    "nccl.services": Field("systemd units that get a drop-in with the NCCL `Environment=`.",
                           "systemd unit names (letters, digits, `:-_.\\@`, a known unit type or none = `.service`; "
                           "no `/`, no leading `.` or `@`; the drop-in directory fits a file name), each once.",
                           "`[vllm]`"),
    "reboot.allowed": Field("May the deploy reboot the host once when needed.", _BOOL, "`false`"),
    "reboot.max_parallel": Field("Nodes of one Proxmox cluster rebooted at once (fewer when quorum needs it).",
                                 "1–64.", "`1`"),
    "reboot.rejoin_timeout": Field("Seconds a rebooted node has to be online in its cluster again, and then to "
                                   "finish its boot (onboot guests started; a warning after it).", _SECONDS, "`300`"),
    "reboot.guests": Field("A cluster node's running GPU guests before it reboots in a roll: `stop` (left to the "
                           "node's shutdown) or `migrate` (pooled VMs moved offline to a node with free devices of "
                           "their pools and back after; GPU containers stopped and started again).",
                           "`stop` or `migrate`.", "`stop`"),
    "reboot.migrate_fallback": Field("`migrate` found no node with free devices for a VM: `refuse` (node not "
                                     "rebooted, the roll stops) or `stop` the VM.", "`refuse` or `stop`.", "`refuse`"),
    "guests.allow_stop": Field("May a rebind stop guests that use a moving GPU.", _BOOL, "`true`"),
    "guests.shutdown_timeout": Field("Seconds a guest gets for a clean `qm/pct shutdown` before a hard stop.",
                                     _SECONDS, "`120`"),
    "proxmox_api.host": Field("Proxmox API host; without `proxmox_api`, `pvesh`/`qm`/`pct` over SSH are used. The "
                              "token needs permission to edit mappings, VM configs and power state.", _HOST,
                              "`kpro6.lab.internal`"),
    "proxmox_api.port": Field("API port.", "1–65535.", "`8006`"),
    "proxmox_api.user": Field("API user.", "A Proxmox user ID `user@realm` (≤ 64).", "`root@pam`"),
    "proxmox_api.token_name": Field("API token name.", "A Proxmox token name (a letter, then letters, digits, "
                                    "`._-`; ≤ 64).", "`pvegpu`"),
    "proxmox_api.token_env": Field("Environment variable holding the token (read when a request is made, held as a "
                                   "secret, never printed).",
                                   "An environment variable name; exactly one of `token_env` and `token_file`.",
                                   "`PVEGPU_API_TOKEN`"),
    "proxmox_api.token_file": Field("File holding the token, on the machine that runs pyinfra.",
                                    _LOCAL_PATH + " Owned by the runner or root and readable by its owner only "
                                    "(0600/0400), else refused.",
                                    "`~/.config/pvegpu/token`"),
    "proxmox_api.verify_ssl": Field("Verify the API's TLS certificate; `false` is warned about at every run.",
                                    _BOOL + " `false` together with `ca_file` is refused.", "`true`"),
    "proxmox_api.ca_file": Field("PEM of the CA that signed the API certificate (a copy of "
                                 "`/etc/pve/pve-root-ca.pem`); unset: the system's CAs.", _LOCAL_PATH + " Not writable by others.",
                                 "`~/.config/pvegpu/pve-root-ca.pem`"),
    "proxmox_ve": Field("The Proxmox VE major the host runs or is being moved to; `9` on a host still on 8 makes "
                        "each run list the upgrade's to-dos ([upgrade 8 → 9](../howto/upgrade-8-to-9.md)).",
                        "`8`, `9` or unset; a `proxmox-git` `kernel.version` of the other major is refused, and at preflight "
                        "`8` on a host whose Debian release is trixie (9).", "`9`"),
    "proxmox_ve_upgrade": Field("With `proxmox_ve: 9` on a host still on 8: `check` lists the upgrade's to-dos "
                                "(read-only); `perform` runs the 8 → 9 upgrade after its preflight (pve8to9 `--full` "
                                "without FAIL, proxmox-ve ≥ 8.4-0, 10 GB free on `/`, GPU guests stoppable, no kernel "
                                "meta-package on hold, no pre-Squid Ceph repository, a bookworm source, no failed "
                                "earlier try): a backup of `/etc/pve`, the apt sources moved to trixie and the "
                                "dist-upgrade detached on the host ([upgrade 8 → 9](../howto/upgrade-8-to-9.md)).",
                                "`check` or `perform`; `perform` needs `proxmox_ve: 9`.", "`perform`"),
}

# rules of the file as a whole (spec/load.py, spec/models.py)
FILE_RULES = [
    "A spec file has `hosts:`, a mapping of host name → host spec; host names are letters, digits, `._-` "
    "(or `@local` for the machine pyinfra runs on).",
    "Unknown keys are errors; no string may hold a control character (newline, NUL, tab …), a line or paragraph "
    "separator (U+2028/9) or a lone surrogate.",
    "Two keys that are the same once read as pydantic reads them (`200:` and `\"200\":`, a `!!binary` key and its "
    "text) are refused.",
    "The file: UTF-8 text, ≤ 1 MiB, one document, nested ≤ 64 levels, aliases expanding to ≤ 100000 values "
    "(\"billion laughs\"); a malformed tag (`!!int abc`, `!!bool maybe`), a number of more than 4300 digits or a "
    "raw control character is one sentence with its line, never a traceback.",
    "A GPU's role and the container/VM lists must agree: a `vm:300` GPU is listed under `vms[300].gpus`, an `lxc` "
    "GPU in at most one container.",
    "Every value is checked for what it becomes when the spec loads, before any connection (`spec/values.py`, "
    "`spec/models.py`); a refusal names the file, host and field, and nothing is changed.",
]


def models_in(annotation) -> tuple[list[type[BaseModel]], bool]:
    """The models inside a field's annotation, and whether they sit in a mapping or list."""
    origin = typing.get_origin(annotation)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation], False
    if origin is typing.Annotated:
        return models_in(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        found = [models_in(a) for a in typing.get_args(annotation)]
        return [m for models, _ in found for m in models], any(many for _, many in found)
    if origin in (dict, list):
        models, _ = models_in(typing.get_args(annotation)[-1])
        return models, bool(models)
    return [], False


def leaf_fields(model: type[BaseModel] = HostSpec, prefix: str = "") -> list[tuple[str, typing.Any, typing.Any]]:
    """(path, annotation, FieldInfo) of every field that holds a value, in the models' order."""
    leaves = []
    for name, info in model.model_fields.items():
        models, many = models_in(info.annotation)
        if not models:
            leaves.append((prefix + name, info.annotation, info))
        for sub in models:
            leaves += leaf_fields(sub, f"{prefix}{name}{'[]' if many else ''}.")
    return leaves


def field_paths() -> list[str]:
    return [path for path, _, _ in leaf_fields()]


def _bounds(metadata) -> str:
    lo = next((m.ge for m in metadata if getattr(m, "ge", None) is not None), None)
    hi = next((m.le for m in metadata if getattr(m, "le", None) is not None), None)
    return f" ({lo}–{hi})" if lo is not None and hi is not None else ""


def type_text(annotation, metadata=()) -> str:
    """A short reading of an annotation: `integer (1–65535)`, `` `auto` | `amd` ``, `list of string`.
    `metadata`: the field's own constraints (pydantic keeps a field's top-level Field(ge=, le=) there)."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        base, *meta = typing.get_args(annotation)
        inner = [m for item in meta for m in [item, *getattr(item, "metadata", [])]]  # Field(ge=, le=) keeps them in .metadata
        return type_text(base) + _bounds(inner)
    if origin is typing.Literal:
        return " | ".join(f"`{a}`" for a in typing.get_args(annotation)) + _bounds(metadata)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(annotation)
        text = " | ".join(type_text(a) for a in args if a is not type(None))
        return text + (" or unset" if type(None) in args else "")
    if origin is list:
        return f"list of {type_text(typing.get_args(annotation)[0])}"
    if origin is dict:
        return f"mapping to {type_text(typing.get_args(annotation)[1])}"
    if isinstance(annotation, type):
        name = {"str": "string", "int": "integer", "bool": "boolean"}.get(annotation.__name__, annotation.__name__)
        return name + _bounds(metadata)
    return str(annotation)


def _yaml(value) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "`true`" if value else "`false`"
    if isinstance(value, list):
        return "`[" + ", ".join(str(v) for v in value) + "]`"
    if isinstance(value, dict):
        return "`{" + ", ".join(f"{k}: {v}" for k, v in value.items()) + "}`"
    return f"`{value}`"


def default_text(path: str, info) -> str:
    """The value a host gets when its spec leaves the field out: group_data/all.py's, else the model's."""
    node: typing.Any = PVEGPU_DEFAULTS
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            node = PydanticUndefined
            break
        node = node[part]
    if node is not PydanticUndefined and not isinstance(node, dict):
        return _yaml(node) + " (group_data)"
    if info.is_required():
        parent = path.rsplit(".", 1)[0] if "." in path else ""
        if parent.endswith("[]"):
            return f"required (in each entry of `{parent[:-2]}`)"
        return "required" + (f" (when `{parent}` is set)" if parent else "")
    if info.default_factory is not None:
        return _yaml(info.default_factory())
    return _yaml(info.default)


def render() -> str:
    lines = [
        "# Spec reference",
        "",
        "<!-- Generated by `python -m spec.reference` (make docs-ref) from spec/models.py, group_data/all.py and "
        "spec/reference.py; do not edit by hand. -->",
        "",
        "A host's spec is YAML under `hosts:` in `inventories/<site>.yml`. Defaults: `group_data/all.py` "
        "(merged under each host; marked *(group_data)*) and the models in `spec/models.py`. A field path "
        "writes a mapping's values and a list's items as `[]`.",
        "",
        "## The file",
        "",
    ]
    lines += [f"- {rule}" for rule in FILE_RULES]
    lines += ["", "## Fields", ""]
    section = None
    for path, annotation, info in leaf_fields():
        top = path.split(".")[0].split("[")[0]
        if top != section and top != path:
            lines += [f"### `{top}`", ""]
        section = top
        entry = FIELDS[path]
        lines += [
            f"{'###' if top == path else '####'} `{path}`",
            "",
            entry.meaning,
            "",
            f"- type: {type_text(annotation, info.metadata)}",
            f"- default: {default_text(path, info)}",
            f"- rule: {entry.rule}",
        ]
        if entry.example:
            lines.append(f"- example: {entry.example}")
        lines.append("")
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        if not PAGE.exists() or PAGE.read_text() != text:
            print(f"{PAGE} is not what `python -m spec.reference` writes; run: make docs-ref", file=sys.stderr)
            return 1
        return 0
    PAGE.parent.mkdir(parents=True, exist_ok=True)
    PAGE.write_text(text)
    print(PAGE)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
