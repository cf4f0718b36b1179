"""The typed host spec (pydantic v2).

A spec file (`inventories/<site>.yml`) looks like::

    hosts:
      kpro6:
        ssh: {hostname: kpro6.lab.example, user: root}
        iommu: {vendor: amd, params: [pci=realloc]}
        nvidia: {version: 595.71.05, ...}
        gpus:
          "0000:01:00.0": lxc
          "0000:41:00.0": {role: "vm:300"}
        containers: {200: {gpus: ["0000:01:00.0"]}}
        vms: {300: {gpus: ["0000:41:00.0"], machine: q35}}

Every model forbids unknown keys (typos are errors). Every string refuses newlines and NUL
bytes, because spec values end up in shell commands and config files. Cross-field rules
(GPU roles vs. containers/VMs, ID ranges) live in `HostSpec`'s validator. Defaults come from
`group_data/all.py` (merged by `spec.load` before validation).
"""

from __future__ import annotations

import os
import re
import unicodedata
from pathlib import Path
from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SecretStr,
    field_validator,
    model_validator,
)

from spec import values as V
from spec.values import NoBool

BDF_RE = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[01][0-9a-f]\.[0-7]$")
# ASCII digits only: Python's \d matches every Unicode digit (595.71.٥), which no driver version holds
DRIVER_VERSION_RE = re.compile(r"^[0-9]{3}\.[0-9]{1,3}(\.[0-9]{1,3})?$")
KERNEL_VERSION_RE = re.compile(r"^[0-9]+\.[0-9]+(\.[0-9]+)?(\+[0-9A-Za-z.~]+)?(-[0-9A-Za-z][0-9A-Za-z.+~-]*)?$")  # 6.12.118+deb12-amd64
# linux include/uapi/linux/utsname.h __NEW_UTS_LEN: `uname -r` is at most 64 characters
KERNEL_RELEASE_MAX = 64
NCCL_KEY_RE = re.compile(r"^NCCL_[A-Z0-9_]+$")
NVREG_KEY_RE = re.compile(r"^NVreg_[A-Za-z0-9_]+$")
SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
ROLE_RE = re.compile(r"^(lxc|host|unused|vm:([0-9]+))$")
GUEST_ID_MIN, GUEST_ID_MAX = 100, 999_999_999


def _no_control(value: str) -> str:
    if "\n" in value or "\r" in value or "\x00" in value:
        raise ValueError("must not contain a newline or NUL byte (it would end up in a shell command or config file)")
    # other control characters and line separators (str.splitlines and many parsers end a line at
    # \v \f \x1c-\x1e \x85 \u2028 \u2029), and lone surrogates, which no UTF-8 file or SSH command holds
    odd = sorted({c for c in value if unicodedata.category(c) in ("Cc", "Cs", "Zl", "Zp")})
    if odd:
        shown = "".join(f"\\u{ord(c):04x}" for c in odd)
        raise ValueError(f"must not contain control characters, line separators or lone surrogates (has {shown})")
    return value


SafeStr = Annotated[str, AfterValidator(_no_control)]


def _bdf(value: str) -> str:
    _no_control(value)
    if not BDF_RE.match(value):
        hint = " (use lowercase hex)" if BDF_RE.match(value.lower()) else ""
        raise ValueError(
            f"{value!r} is not a PCI address{hint}; write domain:bus:device.function like '0000:01:00.0'"
        )
    return value


Bdf = Annotated[str, AfterValidator(_bdf)]


def _guest_id(value: int) -> int:
    if not GUEST_ID_MIN <= value <= GUEST_ID_MAX:
        raise ValueError(f"{value} is outside Proxmox's guest ID range {GUEST_ID_MIN}-{GUEST_ID_MAX}")
    return value


GuestId = Annotated[int, AfterValidator(_guest_id)]


# follows qemu-server PVE/QemuServer/PCI.pm $MAX_HOSTPCI_DEVICES: a VM config has hostpci0..hostpci15
MAX_HOSTPCI_DEVICES = 16


def _checked(check):
    """A SafeStr that must also pass `check` (spec/values.py: what the value becomes).

    The fields below spell it out as ``Annotated[SafeStr, AfterValidator(check)]`` (the same
    type), since a call in an annotation is no type to mypy."""
    return Annotated[SafeStr, AfterValidator(check)]


Port = Annotated[int, NoBool, Field(ge=1, le=65535)]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, defer_build=True)


class SshSpec(Strict):
    """How pyinfra reaches the host (copied into pyinfra host data)."""

    hostname: Annotated[SafeStr, AfterValidator(V.hostname_or_ip)]
    port: Port = 22
    user: Annotated[SafeStr, AfterValidator(V.posix_user)] = "root"
    key: Annotated[SafeStr, AfterValidator(V.local_path)] | None = None  # a file on the machine that runs pyinfra


class IommuSpec(Strict):
    vendor: Literal["auto", "amd", "intel"] = "auto"
    passthrough: bool = False  # adds iommu=pt; refused at preflight on SEV-SNP hosts
    params: list[SafeStr] = Field(default_factory=list)  # extra cmdline params, e.g. pci=realloc
    # pcie_acs_override=<value>, e.g. "downstream,multifunction"
    acs_override: Annotated[SafeStr, AfterValidator(V.acs_override)] | None = None

    @field_validator("params")
    @classmethod
    def _params_are_words(cls, params: list[str]) -> list[str]:
        for p in params:
            V.cmdline_word(p)
        if len(" ".join(params)) > V.CMDLINE_MAX:
            raise ValueError(f"{len(' '.join(params))} characters of parameters; the whole kernel command line "
                             f"holds {V.CMDLINE_MAX}")
        return params


class SourceSpec(Strict):
    """A source archive: fetched from `url` (https://, file:// or a plain local path) and checked."""

    url: Annotated[SafeStr, AfterValidator(V.source_location)]
    sha256: SafeStr

    @field_validator("sha256")
    @classmethod
    def _sha(cls, v: str) -> str:
        return V.sha256_digest(v)


class SigningSpec(Strict):
    """Key and certificate (paths on the host) the NVIDIA modules are signed with for Secure Boot:
    the kernel's scripts/sign-file signs each module (sha256); the cert must be enrolled (MOK)."""

    key: SafeStr
    cert: SafeStr

    @field_validator("key", "cert")
    @classmethod
    def _absolute(cls, v: str) -> str:
        if not v.startswith("/"):
            raise ValueError(f"{v!r} is not an absolute path on the host")
        return V.host_abs_path(v)  # as every host path: no '.', '..', '//', at most 4095


class KernelSourceSpec(Strict):
    kind: Literal["proxmox-git", "tarball"] = "proxmox-git"
    url: SafeStr  # proxmox-git: spec.values.git_url; tarball: spec.values.source_location
    ref: Annotated[SafeStr, AfterValidator(V.git_ref)] | None = None  # proxmox-git: the full id of the commit to build
    sha256: SafeStr | None = None  # for tarball

    @model_validator(mode="after")
    def _pinned(self) -> KernelSourceSpec:
        if self.kind == "proxmox-git" and not self.ref:
            raise ValueError("a proxmox-git source needs 'ref' (the full 40-hex id of the commit to build) so builds are "
                             "reproducible and what is built is what was reviewed")
        try:
            (V.git_url if self.kind == "proxmox-git" else V.source_location)(self.url)
        except ValueError as exc:
            raise ValueError(f"@url: {exc}") from None
        if self.kind == "tarball" and not (self.sha256 and SHA256_RE.match(self.sha256)):
            raise ValueError("a tarball source needs 'sha256' (64 lowercase hex characters)")
        return self


class KernelSpec(Strict):
    version: SafeStr  # the release the build produces, e.g. 6.14.8-2-pve
    source: KernelSourceSpec
    config_fragments: list[Annotated[SafeStr, AfterValidator(V.kconfig_line)]] = Field(default_factory=list)  # CONFIG_X=y lines
    # the config the build starts from: the running kernel's (/boot/config-$(uname -r)), a make
    # target (tinyconfig, defconfig, allnoconfig) or an absolute path to a config file
    base_config: SafeStr = "running"
    jobs: Annotated[Literal["auto"] | int, BeforeValidator(V.build_jobs)] = "auto"  # auto: min(cores, RAM/2GiB)
    ccache: bool = True
    trial_boot: bool = True
    # seconds a trial kernel waits after a panic before it resets (panic= on the trial entry only)
    trial_panic_s: Annotated[int, NoBool, Field(ge=1, le=3600)] = 10
    remove_old: bool = False
    # in a run of several hosts: this host builds the .debs for the others of its build inputs (issue 41)
    share_builder: bool = False
    # with Secure Boot on: the MOK the kernel image is signed with (sbsign), as nvidia.signing
    # (key: PEM private key, cert: the DER certificate enrolled with mokutil --import)
    signing: SigningSpec | None = None

    @field_validator("base_config")
    @classmethod
    def _base_config(cls, v: str) -> str:
        if v not in ("running", "tinyconfig", "defconfig", "allnoconfig") and not v.startswith("/"):
            raise ValueError(f"{v!r}: use 'running', 'tinyconfig', 'defconfig', 'allnoconfig' or an absolute path")
        return v if not v.startswith("/") else V.host_abs_path(v)

    @field_validator("version")
    @classmethod
    def _version(cls, v: str) -> str:
        if not KERNEL_VERSION_RE.match(v):
            raise ValueError(f"{v!r} is not a kernel release; write it like '6.14.8-2-pve'")
        if len(v) > KERNEL_RELEASE_MAX:
            raise ValueError(f"a release of {len(v)} characters; a kernel release is at most {KERNEL_RELEASE_MAX}")
        return v


class NvidiaSpec(Strict):
    version: SafeStr
    open: bool = True
    modules_source: SourceSpec | None = None  # open-gpu-kernel-modules archive
    installer: SourceSpec | None = None  # NVIDIA-Linux-x86_64-<ver>.run (user space + GSP firmware)
    firmware: bool = True
    uvm_disable_hmm: Literal["auto"] | bool = "auto"  # auto: on for Blackwell (incident 3)
    nvreg: dict[SafeStr, Annotated[int | SafeStr, AfterValidator(V.nvreg_value)]] = Field(default_factory=dict)
    persistenced: bool = True
    # in a run of several hosts: this host builds for the others of its build inputs (issue 41)
    share_builder: bool = False
    signing: SigningSpec | None = None  # sign the modules (Secure Boot); refused unset when Secure Boot is on
    # kernel releases to build for; default: the running one plus the kernel stage's
    releases: list[SafeStr] | None = None

    @field_validator("releases")
    @classmethod
    def _releases(cls, v: list[str] | None) -> list[str] | None:
        if v is None:
            return v
        if not v:
            raise ValueError("nvidia.releases is empty; leave it out to build for the running kernel and the kernel stage's")
        for release in v:
            if not KERNEL_VERSION_RE.match(release):
                raise ValueError(f"{release!r} is not a kernel release; write it like '6.14.8-2-pve'")
            if len(release) > KERNEL_RELEASE_MAX:
                raise ValueError(f"{release!r} is longer than a kernel release can be ({KERNEL_RELEASE_MAX})")
        return list(dict.fromkeys(v))

    @field_validator("version")
    @classmethod
    def _version(cls, v: str) -> str:
        if not DRIVER_VERSION_RE.match(v):
            raise ValueError(f"{v!r} is not an NVIDIA driver version; write it like '595.71.05'")
        return v

    @field_validator("nvreg")
    @classmethod
    def _nvreg(cls, v: dict) -> dict:
        for k in v:
            if not NVREG_KEY_RE.match(k):
                raise ValueError(f"{k!r}: nvidia module options are NVreg_* names, like 'NVreg_EnableGpuFirmware'")
        return v


class GpuSpec(Strict):
    """What one GPU (by PCI address) is for.

    role: `lxc` (host nvidia driver, shared into containers), `vm:<vmid>` (vfio-pci
    passthrough), `host` (nvidia driver, host use only), `unused` (bound to vfio-pci so no
    host process grabs it; set `unused_driver: none` to leave it unbound).
    """

    role: SafeStr
    unused_driver: Literal["vfio-pci", "none"] = "vfio-pci"

    @field_validator("role")
    @classmethod
    def _role(cls, v: str) -> str:
        m = ROLE_RE.match(v)
        if not m:
            raise ValueError(f"{v!r} is not a role; allowed: 'lxc', 'vm:<vmid>', 'host', 'unused'")
        if m.group(2):
            _guest_id(int(m.group(2)))
        return v

    @property
    def vmid(self) -> int | None:
        m = ROLE_RE.match(self.role)
        return int(m.group(2)) if m and m.group(2) else None

    @property
    def driver(self) -> str | None:
        """The kernel driver this role binds to (None: leave unbound)."""
        if self.role in ("lxc", "host"):
            return "nvidia"
        if self.role == "unused":
            return None if self.unused_driver == "none" else "vfio-pci"
        return "vfio-pci"


def _nccl_keys(v: dict) -> dict:
    from plan.nccl import override_problem  # pure: NCCL's own reading of a value (levels, verbatim values)

    for k in v:
        if not NCCL_KEY_RE.match(k):
            raise ValueError(f"{k!r} is not an NCCL variable; NCCL keys are NCCL_* in upper case, like 'NCCL_P2P_DISABLE'")
        problem = override_problem(k, str(v[k]))
        if problem:
            raise ValueError(problem)
    return v


NcclOverrides = Annotated[dict[SafeStr, Annotated[SafeStr | int, AfterValidator(V.nccl_value)]],
                          AfterValidator(_nccl_keys)]


class ContainerSpec(Strict):
    gpus: list[Bdf] = Field(default_factory=list)
    nccl: NcclOverrides = Field(default_factory=dict)
    # the host's exact NVIDIA user space (nvidia.installer, without kernel modules) in the CT:
    # true = install it (needs nvidia.installer), false = the CT's own business,
    # unset = install it when nvidia.installer is configured
    userspace_driver: bool | None = None
    # group of /dev/nvidia* in the CT: Debian's `video` (44; PVE 8's `render` is 104) unless the
    # CT says otherwise; Proxmox's default id map of an unprivileged CT covers 0-65535
    gid: Annotated[int, NoBool, Field(ge=0, le=65535)] = 44
    # device nodes beyond what CUDA needs (its GPUs, /dev/nvidiactl, /dev/nvidia-uvm), for a CT that
    # asks: uvm-tools (/dev/nvidia-uvm-tools: profilers, debuggers), mig-config / mig-monitor
    # (/dev/nvidia-caps/nvidia-cap1 / -cap2: MIG management; privileged CTs only). plan/guests.py
    extra_devices: list[Literal["uvm-tools", "mig-config", "mig-monitor"]] = Field(default_factory=list)

    @field_validator("extra_devices")
    @classmethod
    def _each_extra_once(cls, v: list[str]) -> list[str]:
        twice = sorted({e for e in v if v.count(e) > 1})
        if twice:
            raise ValueError(f"{', '.join(twice)} listed twice")
        return v

    @model_validator(mode="after")
    def _extra_needs_gpus(self) -> ContainerSpec:
        if self.extra_devices and not self.gpus:
            raise ValueError("extra_devices without gpus: the extra NVIDIA nodes are given only to a CT with GPUs")
        return self


class VmSpec(Strict):
    gpus: list[Bdf] = Field(default_factory=list)
    machine: Literal["q35", "i440fx"] = "q35"
    allow_machine_change: bool = False  # opt-in: switch an i440fx VM to q35 for pcie=1
    # a GPU pool: the VM's GPUs become this node's entries of the cluster-wide mapping of this
    # name (every node's VMs of the pool add theirs), its hostpciN lines reference the pool, so
    # the VM can start on any node with a free GPU of the pool (plan/guests.py)
    pool: Annotated[SafeStr, AfterValidator(V.gpu_pool)] | None = None


class NcclSpec(Strict):
    profile: Literal["auto", "none"] = "auto"
    overrides: NcclOverrides = Field(default_factory=dict)
    services: list[Annotated[SafeStr, AfterValidator(V.systemd_unit_entry)]] = Field(default_factory=list)  # systemd units that get a drop-in

    @field_validator("services")
    @classmethod
    def _one_dropin_each(cls, v: list[str]) -> list[str]:
        units = [V.systemd_unit(s) for s in v]
        twice = sorted({u for u in units if units.count(u) > 1})
        if twice:
            raise ValueError(f"{', '.join(twice)} listed twice (a name without a type means .service)")
        return v


class RebootSpec(Strict):
    allowed: bool = False
    # nodes of one Proxmox cluster rebooted at once in a run (fewer when quorum needs it): each
    # back in its cluster, quorate, before the next (operations/reboot.py)
    max_parallel: Annotated[int, NoBool, Field(ge=1, le=64)] = 1
    # seconds a rebooted node may take to be online in its cluster again (after SSH answers), and
    # then to finish its boot, onboot guests started (operations/reboot.py boot_done_or_warn)
    rejoin_timeout: Annotated[int, NoBool, Field(ge=1, le=3600)] = 300
    # a cluster node's running GPU guests before it reboots in a roll (operations/reboot.py): `stop`
    # leaves them to the node's shutdown; `migrate` moves each VM of a GPU pool offline to another
    # node of the run with free devices of its pools and back after, stops GPU containers and
    # starts them again after
    guests: Literal["stop", "migrate"] = "stop"
    # `migrate` found no node with free devices for a VM: `refuse` (the node is not rebooted, the
    # roll stops) or `stop` (the VM is stopped, and started again after the reboot)
    migrate_fallback: Literal["refuse", "stop"] = "refuse"


class GuestPolicy(Strict):
    allow_stop: bool = True  # may a rebind stop running guests that use the GPU?
    # seconds a guest gets to shut down cleanly (qm/pct shutdown --timeout) before it is stopped
    shutdown_timeout: Annotated[int, NoBool, Field(ge=1, le=3600)] = 120


class ProxmoxApiSpec(Strict):
    """Optional Proxmox API access; without it pvegpu uses `pvesh` over SSH.

    The token comes from an environment variable or a file, never from the spec itself.
    """

    host: Annotated[SafeStr, AfterValidator(V.hostname_or_ip)]
    port: Port = 8006
    user: Annotated[SafeStr, AfterValidator(V.pve_userid)] = "root@pam"
    token_name: Annotated[SafeStr, AfterValidator(V.pve_token_name)]
    token_env: Annotated[SafeStr, AfterValidator(V.env_name)] | None = None
    token_file: Annotated[SafeStr, AfterValidator(V.local_path)] | None = None
    verify_ssl: bool = True
    # PEM file of the CA that signed the API's certificate (PVE's own: a copy of
    # /etc/pve/pve-root-ca.pem); unset: the system's CAs
    ca_file: Annotated[SafeStr, AfterValidator(V.local_path)] | None = None

    @model_validator(mode="after")
    def _one_source(self) -> ProxmoxApiSpec:
        if bool(self.token_env) == bool(self.token_file):
            raise ValueError("set exactly one of 'token_env' (environment variable name) or 'token_file' (path)")
        if self.ca_file and not self.verify_ssl:  # issue 39 item 5: the CA would be ignored without a word
            raise ValueError("@ca_file: is set but verify_ssl is false, so the certificate would not be checked "
                             "against it (nor against anything); drop verify_ssl: false to check it with ca_file")
        return self

    def token(self) -> SecretStr:
        """Read the token value; it stays wrapped in SecretStr (prints as '**********').
        A token_file must be the runner's (or root's) and readable by nobody else (mode 0600 or
        0400), as OpenSSH wants of a private key (sshkey_perm_ok in authfile.c)."""
        if self.token_env:
            value = os.environ.get(self.token_env)
            if value is None:
                raise ValueError(f"environment variable {self.token_env} (proxmox_api.token_env) is not set")
        elif self.token_file:
            path = Path(self.token_file).expanduser()
            with open(path, "rb") as f:
                st = os.fstat(f.fileno())
                if st.st_uid not in (os.geteuid(), 0) or st.st_mode & 0o077:
                    raise ValueError(f"proxmox_api.token_file {path} is mode {st.st_mode & 0o7777:04o}, owner uid "
                                     f"{st.st_uid}: a token file must be readable by its owner only (chmod 600, owned "
                                     "by the user who runs pvegpu), else other accounts of this machine can read "
                                     "the token")
                value = f.read().decode().strip()
        else:  # _one_source already refused a spec with neither
            raise ValueError("set exactly one of 'token_env' (environment variable name) or 'token_file' (path)")
        return SecretStr(value)


class HostSpec(Strict):
    ssh: SshSpec | None = None
    node: Annotated[SafeStr, AfterValidator(V.pve_node)] | None = None  # Proxmox node name; must be the host's (`uname -n` without the domain), which is the default
    boot_loader: Literal["auto", "grub", "systemd-boot"] = "auto"
    iommu: IommuSpec = Field(default_factory=IommuSpec)
    kernel: KernelSpec | None = None
    # how Proxmox kernels move between runs (operations/kernel_hook.py): follow (apt installs them; the
    # kernel hook builds nvidia for each) or hold (the kernel meta-packages held at the spec's kernel series,
    # else the running one's)
    kernel_updates: Literal["follow", "hold"] = "follow"
    nvidia: NvidiaSpec | None = None
    gpus: dict[Bdf, GpuSpec] = Field(default_factory=dict)
    containers: dict[GuestId, ContainerSpec] = Field(default_factory=dict)
    vms: dict[GuestId, VmSpec] = Field(default_factory=dict)
    nccl: NcclSpec = Field(default_factory=NcclSpec)
    reboot: RebootSpec = Field(default_factory=RebootSpec)
    guests: GuestPolicy = Field(default_factory=GuestPolicy)
    proxmox_api: ProxmoxApiSpec | None = None
    # the Proxmox VE major the host runs or is being moved to: 9 makes the run report what to fix for
    # the 8 -> 9 upgrade and, after it, what is still due (operations/upgrade.py); a pve-kernel build
    # must be of this major (plan/releases.py); None: not checked
    proxmox_ve: Literal[8, 9] | None = None
    # what a run does while the host is on 8 and proxmox_ve is 9: `check` lists the upgrade's to-dos
    # (read-only), `perform` runs the 8 -> 9 upgrade itself after its preflight (operations/upgrade.py)
    proxmox_ve_upgrade: Literal["check", "perform"] = "check"

    @field_validator("gpus", mode="before")
    @classmethod
    def _role_shorthand(cls, v):
        # `"0000:01:00.0": lxc` is shorthand for `{role: lxc}`
        if isinstance(v, dict):
            return {k: ({"role": r} if isinstance(r, str) else r) for k, r in v.items()}
        return v

    @model_validator(mode="after")
    def _cross_check(self) -> HostSpec:
        errors: list[str] = []
        both = set(self.containers) & set(self.vms)
        for gid in sorted(both):
            errors.append(f"@vms[{gid}]: ID {gid} is used by a container and a VM; Proxmox guest IDs are unique per cluster")

        ct_of: dict[str, int] = {}
        for ctid, ct in self.containers.items():
            for bdf in ct.gpus:
                where = f'containers[{ctid}].gpus'
                if bdf in ct_of and ct_of[bdf] != ctid:
                    errors.append(f'@{where}: GPU "{bdf}" is already given to container {ct_of[bdf]}; a GPU belongs to one container')
                ct_of[bdf] = ctid
                gpu = self.gpus.get(bdf)
                if gpu is None:
                    errors.append(f'@{where}: GPU "{bdf}" is not declared under gpus; add it with role lxc')
                elif gpu.role != "lxc":
                    errors.append(f'@{where}: GPU "{bdf}" has role {gpu.role!r}, but a container can only use GPUs with role lxc')
            if len(ct.gpus) != len(set(ct.gpus)):
                errors.append(f"@containers[{ctid}].gpus: lists a GPU twice")

        vm_of: dict[str, int] = {}
        for vmid, vm in self.vms.items():
            if len(vm.gpus) > MAX_HOSTPCI_DEVICES:
                errors.append(f"@vms[{vmid}].gpus: lists {len(vm.gpus)} GPUs, but a Proxmox VM has at most "
                              f"{MAX_HOSTPCI_DEVICES} PCI passthrough lines (hostpci0-hostpci{MAX_HOSTPCI_DEVICES - 1}); "
                              "each GPU takes one")
            for bdf in vm.gpus:
                where = f"vms[{vmid}].gpus"
                if bdf in vm_of and vm_of[bdf] != vmid:
                    errors.append(f'@{where}: GPU "{bdf}" is already given to VM {vm_of[bdf]}')
                vm_of[bdf] = vmid
                gpu = self.gpus.get(bdf)
                if gpu is None:
                    errors.append(f'@{where}: GPU "{bdf}" is not declared under gpus; add it with role "vm:{vmid}"')
                elif gpu.role != f"vm:{vmid}":
                    errors.append(f'@{where}: GPU "{bdf}" has role {gpu.role!r}, but VM {vmid} can only use GPUs with role "vm:{vmid}"')

        # the release rule (plan/releases.py): a pve-kernel build is of proxmox_ve's release
        # (pve-kernel Makefile: bookworm branches set KREL_EXTRA=-bpo12, trixie branches and master none)
        if self.kernel is not None:
            from plan.releases import spec_kernel_refusal  # pure, no imports of its own

            wrong = spec_kernel_refusal(self.proxmox_ve, self.kernel.version, self.kernel.source.kind == "proxmox-git")
            if wrong:
                errors.append(f"@kernel.version: {wrong}")
        if self.proxmox_ve_upgrade == "perform" and self.proxmox_ve != 9:
            errors.append("@proxmox_ve_upgrade: 'perform' runs the upgrade to Proxmox VE 9 and needs proxmox_ve: 9 "
                          f"(it is {self.proxmox_ve if self.proxmox_ve is not None else 'unset'}); set proxmox_ve: 9, "
                          "or leave proxmox_ve_upgrade out (check: the read-only list of the upgrade's to-dos)")
        if self.proxmox_ve == 9:
            from plan.releases import legacy_cgroup_param

            legacy = legacy_cgroup_param(self.iommu.params)
            if legacy:  # pve-manager PVE/CLI/pve8to9.pm checklist: the hybrid cgroup layout is gone in 9
                errors.append(f"@iommu.params: {legacy} asks for the legacy (cgroup v1) layout, which Proxmox VE 9 "
                              "removed (pve8to9 fails on it); take it out")

        for ctid, ct in self.containers.items():
            if ct.userspace_driver is True and ct.gpus and (self.nvidia is None or self.nvidia.installer is None):
                errors.append(
                    f"@containers[{ctid}].userspace_driver: installing the host's NVIDIA user space in CT {ctid} "
                    "needs nvidia.installer (the NVIDIA-Linux-x86_64-<version>.run of the host's driver and its "
                    "sha256); set it, or leave userspace_driver out (or false) to manage the CT's driver libraries yourself")

        for bdf, gpu in self.gpus.items():
            if gpu.vmid is not None:
                if gpu.vmid not in self.vms:
                    errors.append(f'@gpus["{bdf}"].role: VM {gpu.vmid} is not declared under vms; add it with this GPU')
                elif bdf not in self.vms[gpu.vmid].gpus:
                    errors.append(f'@gpus["{bdf}"].role: says "vm:{gpu.vmid}" but vms[{gpu.vmid}].gpus does not list it')
                if bdf in ct_of:
                    errors.append(f'@gpus["{bdf}"]: is given to VM {gpu.vmid} and to container {ct_of[bdf]}; one GPU, one role')

        if errors:
            raise ValueError("\n".join(errors))
        return self

    # -- derived views used by the plan layer ---------------------------------------------
    def gpus_of_container(self, ctid: int) -> list[str]:
        return list(self.containers[ctid].gpus)

    def gpus_of_vm(self, vmid: int) -> list[str]:
        return list(self.vms[vmid].gpus)


class SpecFile(Strict):
    hosts: dict[SafeStr, HostSpec]

    @field_validator("hosts")
    @classmethod
    def _names(cls, v: dict) -> dict:
        for name in v:
            if name != "@local" and not re.match(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$", name):
                raise ValueError(f"{name!r}: host names are letters, digits, '.', '_' and '-' (or '@local' for this machine)")
        return v
