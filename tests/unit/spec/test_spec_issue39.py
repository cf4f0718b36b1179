"""Issue 39 (security): spec values that would let the network or a careless setting reach root
or a secret are refused at load, each refusal naming the file, the host and the field."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from spec.load import SpecError, load_spec_file

REPO = Path(__file__).resolve().parents[3]
KPRO6 = yaml.safe_load((REPO / "inventories" / "kpro6.yml").read_text())


def host() -> dict:
    return copy.deepcopy(KPRO6["hosts"]["kpro6"])


def refusal(tmp_path: Path, h: dict) -> str:
    f = tmp_path / "site.yml"
    f.write_text(yaml.safe_dump({"hosts": {"kpro6": h}}))
    with pytest.raises(SpecError) as exc:
        load_spec_file(f)
    return str(exc.value)


def assert_names(msg: str, tmp_path: Path, field: str, words: str) -> None:
    lines = [line for line in msg.splitlines() if f"{field}:" in line]
    assert str(tmp_path / "site.yml") in msg, msg
    assert lines and "host kpro6" in lines[0], msg
    assert any(words in line for line in lines), (words, lines)


# ------------------------------------------------------------------ item 3: a pinned kernel source

@pytest.mark.parametrize("url, ref", [
    ("git://git.proxmox.com/git/pve-kernel.git", "v6.14.11-4"),            # a tag over git:// (no authentication)
    ("http://git.proxmox.com/git/pve-kernel.git", "refs/tags/v6.14.11-4"),  # over http://
    ("https://git.proxmox.com/git/pve-kernel.git", "bookworm-6.14"),        # a branch moves, whatever the transport
    ("https://git.proxmox.com/git/pve-kernel.git", "ad58d14"),              # an abbreviated id
    ("https://git.proxmox.com/git/pve-kernel.git", "AD58D1445425EA4742E3470B2EDBEE35DF0657E9"),
])
def test_a_kernel_source_ref_that_is_not_a_full_commit_id_is_refused(tmp_path, url, ref):
    h = host()
    h["kernel"]["source"].update(url=url, ref=ref)
    assert_names(refusal(tmp_path, h), tmp_path, "hosts.kpro6.kernel.source.ref", "is not a full commit id")


def test_a_tag_refusal_says_how_to_pin_the_commit(tmp_path):
    h = host()
    h["kernel"]["source"]["ref"] = "v6.14.11-4"
    msg = refusal(tmp_path, h)
    assert "can be moved" in msg and "git ls-remote" in msg


# ------------------------------------------------------------------ item 5: TLS off without a word

def test_a_ca_file_beside_verify_ssl_false_is_refused(tmp_path):
    h = host()
    h["proxmox_api"] = {"host": "10.0.0.5", "token_name": "pvegpu", "token_env": "PVE_TOKEN",
                        "verify_ssl": False, "ca_file": "~/pve-root-ca.pem"}
    assert_names(refusal(tmp_path, h), tmp_path, "hosts.kpro6.proxmox_api.ca_file", "verify_ssl is false")
