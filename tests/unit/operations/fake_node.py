"""A fake Proxmox VE node for unit tests that run facts in a real local shell: this node's guest
configs under a temporary /etc/pve, lxc's view of the running CTs (`lxc-ls --active`, `lxc-info
-p` as lxc prints them), and, as root, a real init process per running CT whose root is the CT's
own root filesystem, so `/proc/<pid>/root` reads the CT's files as on a node; `pct exec` enters
that init's mount namespace and root (as lxc-attach does). `rewrite` points a fact's absolute
/etc/pve and /var/run/qemu-server paths at the fake ones."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

NODE = "gpu1"

# lxc's tools as far as the facts use them (lxc src/lxc/tools/lxc_ls.c, lxc_info.c): the
# running CTs one per line; a running CT's init pid, bare with -p -H; nothing for a stopped one
LXC_LS = """#!/bin/sh
cat "$FAKE_NODE/active" 2>/dev/null
"""
LXC_INFO = """#!/bin/sh
while [ $# -gt 0 ]; do case "$1" in -n) id=$2; shift ;; esac; shift; done
grep -qx "$id" "$FAKE_NODE/active" 2>/dev/null && cat "$FAKE_NODE/ct$id.pid" 2>/dev/null
exit 0
"""
# uname with this node's name: the real one's fields (coreutils prints the node name first
# unless -s/-a asks for the kernel name), the node name swapped
UNAME = f"""#!/bin/sh
out=$(/bin/uname "$@") || exit $?
case " $* " in *" -n "*) n=$(/bin/uname -n); out="{NODE}.example.org${{out#"$n"}}";; esac
printf '%s\\n' "$out"
"""
# pct: `list` is not what the facts use any more (a test fails if they run it); `push` copies
# into the CT's root; `exec ID -- CMD…` runs CMD in the CT's init's mount namespace and root
PCT = r"""#!/bin/sh
echo "$*" >> "$FAKE_NODE/calls"
root="$FAKE_NODE/ct$2"
case "$1" in
push) cp "$3" "$root$4" && { [ "$5" != --perms ] || chmod "$6" "$root$4"; } ;;
exec) pid=$(cat "$FAKE_NODE/ct$2.pid"); shift 3
      exec nsenter --target "$pid" --mount --root --wd -- "$@" ;;
*) echo "fake pct: $1 not supported" >&2; exit 255 ;;
esac
"""


def rewrite(env: dict, command: str) -> str:
    """`command` with /etc/pve and /var/run/qemu-server under the fake node of `env` (if any)."""
    fake = env.get("FAKE_NODE")
    if not fake:
        return command
    return command.replace("/etc/pve/", f"{fake}/pve/").replace("/var/run/qemu-server/", f"{fake}/qemu-server/")


class FakeNode:
    def __init__(self, tmp_path: Path):
        self.dir = tmp_path / "node"
        self.bin = tmp_path / "node-bin"
        for d in (self.dir / "pve/nodes" / NODE / "lxc", self.dir / "pve/nodes" / NODE / "qemu-server",
                  self.dir / "qemu-server", self.bin):
            d.mkdir(parents=True, exist_ok=True)
        perl = '#!/bin/sh\necho "$(basename "$0") $*" >> "$FAKE_NODE/calls"; exit 1\n'  # logged, refused
        for name, text in (("lxc-ls", LXC_LS), ("lxc-info", LXC_INFO), ("uname", UNAME), ("pct", PCT),
                           ("qm", perl), ("pvesh", perl), ("pveversion", perl)):
            (self.bin / name).write_text(text)
            (self.bin / name).chmod(0o755)
        (self.dir / "active").write_text("")
        self.inits: list[subprocess.Popen] = []
        self.env = dict(os.environ, PATH=f"{self.bin}:{os.environ['PATH']}", FAKE_NODE=str(self.dir))

    def calls(self) -> list[str]:
        """Every Proxmox CLI call so far (`pct`, `qm`, `pvesh`, `pveversion`: Perl on a node)."""
        path = self.dir / "calls"
        return path.read_text().splitlines() if path.exists() else []

    def rewrite(self, command: str) -> str:
        return rewrite(self.env, command)

    def ct(self, ctid: int, status: str = "stopped") -> Path:
        """CT `ctid`'s config and root (bin/lib/… as the host's links, /usr an overlay of the host's
        while it runs); `status` running starts its init (root only)."""
        (self.dir / "pve/nodes" / NODE / "lxc" / f"{ctid}.conf").write_text("hostname: llm\n")
        root = self.dir / f"ct{ctid}"
        for sub in ("usr", "etc", "root", "tmp", ".usr-upper", ".usr-work"):
            (root / sub).mkdir(parents=True, exist_ok=True)
        for link in ("bin", "lib", "lib64", "sbin"):
            if Path(f"/{link}").is_symlink() and not (root / link).is_symlink():
                (root / link).symlink_to(os.readlink(f"/{link}"))
        if status == "running":
            self.start(ctid)
        return root

    def start(self, ctid: int) -> None:
        root = self.dir / f"ct{ctid}"
        init = subprocess.Popen(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c",
             'mount -t overlay overlay -o "lowerdir=/usr,upperdir=$0/.usr-upper,workdir=$0/.usr-work" "$0/usr" '
             '&& exec chroot "$0" sleep 600', str(root)])
        self.inits.append(init)
        for _ in range(500):  # up once its root is the CT's
            try:
                if os.readlink(f"/proc/{init.pid}/root") == str(root):
                    break
            except OSError:
                pass
            subprocess.run(["sleep", "0.01"], check=False)
        (self.dir / f"ct{ctid}.pid").write_text(f"{init.pid}\n")
        active = (self.dir / "active").read_text().split()
        (self.dir / "active").write_text("".join(f"{i}\n" for i in sorted({*active, str(ctid)})))

    def stop(self) -> None:
        for init in self.inits:
            init.kill()
            init.wait()
        self.inits = []
