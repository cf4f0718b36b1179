"""Issue 31: every spec value the loader accepts stays what it is where it lands.

One parametrized test per class that got through before: kernel command-line words GRUB or
the kernel would read differently, git refs and URLs that git would take as options, hosts that
are URL fragments, keys that pydantic reads as one, YAML that raised a traceback, and lengths
beyond what the consumer keeps. Each row names the field the refusal must name.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from spec import values as V
from spec.load import SpecError, load_spec_file, validate_spec

REPO = Path(__file__).resolve().parents[3]
KPRO6 = yaml.safe_load((REPO / "inventories" / "kpro6.yml").read_text())


def host() -> dict:
    return copy.deepcopy(KPRO6["hosts"]["kpro6"])


def load_text(tmp_path: Path, text: str) -> str:
    """The one SpecError message loading `text` gives (anything else fails the test)."""
    f = tmp_path / "site.yml"
    f.write_bytes(text.encode("utf-8", "surrogatepass"))
    with pytest.raises(SpecError) as exc:
        load_spec_file(f)
    msg = str(exc.value)
    assert str(f) in msg and "Nothing was changed on any host." in msg
    return msg


def refused(tmp_path: Path, h: dict, path: str, words: str) -> str:
    msg = load_text(tmp_path, yaml.safe_dump({"hosts": {"kpro6": h}}))
    lines = [line for line in msg.splitlines() if f"{path}:" in line]
    assert lines and "host kpro6" in lines[0], f"no error for {path} in:\n{msg}"
    assert any(words in line for line in lines), f"{words!r} not in {lines}"
    return msg


def accepted(tmp_path: Path, h: dict):
    return validate_spec({"hosts": {"kpro6": h}}, tmp_path / "site.yml")["kpro6"]


# ------------------------------------------------------------------ kernel command-line words

@pytest.mark.parametrize("word, words", [
    ("quiet;reboot", "not ';'"),  # ';' ends a command in grub.cfg: the host would reboot at every boot
    ("a&b", "not '&'"), ("a|b", "not '|'"), ("a<b", "not '<'"), ("a>b", "not '>'"),
    ("x=$root", "not '$'"), ("x={a}", "not '{}'"), ("#x", "not '#'"), ("x='a'", "not \"'\""),
    ('x="ab"', "not '\"'"), ("x=a\\b", "not '\\\\'"), ("x=a\u00a0b", "without spaces"),
    ("--", "starts with a letter, digit or '_'"),  # kernel/params.c: the rest goes to init
    ("-s", "starts with a letter, digit or '_'"),  # init would boot single-user
    ("=x", "starts with a letter, digit or '_'"),
])
def test_cmdline_words_are_what_grub_and_the_kernel_read_as_one_word(tmp_path, word, words):
    h = host()
    h["iommu"]["params"] = ["pci=realloc", word]
    refused(tmp_path, h, "hosts.kpro6.iommu.params", words)


def test_usual_cmdline_words_still_pass(tmp_path):
    h = host()
    h["iommu"]["params"] = ["pci=realloc", "vfio-pci.ids=10de:2204,10de:1aef", "console=ttyS0,115200n8",
                            "video=efifb:off", "pcie_aspm=off", "8250.nr_uarts=4", "_x=a-b--c"]
    assert accepted(tmp_path, h).iommu.params[-1] == "_x=a-b--c"


# ------------------------------------------------------------------ git refs and URLs

@pytest.mark.parametrize("ref", [
    "--", "-b", "--upload-pack=touch x", "a..b", "v1@{1}", "@", "v1.lock", ".v1", "a b", "HEAD~1", "v1^", "a:b",
    "a*", "a?", "a[", "a\\b", "/v1", "v1/", "v1.", "a//b", "x\x7f", "v" * 256,
])
def test_kernel_source_ref_is_a_ref_git_takes_and_never_an_option(tmp_path, ref):
    # issue 39 item 3 narrowed the rule to full commit ids: these are refused by that rule now
    h = host()
    h["kernel"]["source"]["ref"] = ref
    words = "control characters" if "\x7f" in ref else "is not a full commit id"
    refused(tmp_path, h, "hosts.kpro6.kernel.source.ref", words)


@pytest.mark.parametrize("ref", ["a" * 40, "b" * 64, "ad58d1445425ea4742e3470b2edbee35df0657e9"])
def test_usual_refs_pass(tmp_path, ref):
    h = host()
    h["kernel"]["source"]["ref"] = ref
    assert accepted(tmp_path, h).kernel.source.ref == ref


@pytest.mark.parametrize("url, words", [
    ("-oProxyCommand=touch x", "a git source is an https://"),
    ("--upload-pack=touch x", "a git source is an https://"),
    ("ext::sh -c touch% x", "a git source is an https://"),
    ("git.proxmox.com:git/pve-kernel.git", "a git source is an https://"),
    ("https://user:secret@git.example/x.git", "holds a password"),
    ("https://git.example/x.git#frag", "fragment"),
    ("https://[fe80::1%eth0]/x.git", "without a zone id"),
    ("https://-oProxyCommand/x.git", "not a host name"),
    ("https://git.example/a b.git", "RFC 3986"),
    ("https://git.example/" + "a" * 2100, "at most 2048"),
    ("file://etc/x", "not an absolute path"),
    ("/srv/../etc/x", "holds '.' or '..'"),
])
def test_kernel_git_url_is_a_url_with_a_host(tmp_path, url, words):
    h = host()
    h["kernel"]["source"]["url"] = url
    refused(tmp_path, h, "hosts.kpro6.kernel.source.url", words)


@pytest.mark.parametrize("url", ["git://git.proxmox.com/git/pve-kernel.git", "https://git.proxmox.com/git/pve-kernel.git",
                                 "ssh://git@git.example:2222/pve-kernel.git", "/srv/pve-kernel", "file:///srv/pve-kernel",
                                 "https://[2001:db8::1]:8443/pve-kernel.git"])
def test_usual_git_urls_pass(tmp_path, url):
    h = host()
    h["kernel"]["source"]["url"] = url
    assert accepted(tmp_path, h).kernel.source.url == url


@pytest.mark.parametrize("where, url, words", [
    ("tarball", "-o/etc/passwd", "a source is an https:// URL"),
    ("tarball", "https://cdn.example/" + "l" * 190 + ".tar.xz", "a file name of at most 255 bytes"),
    ("installer", "https://x.example/" + "a" * 2100, "at most 2048"),
    ("installer", "https://x.example:99999/a.run", "not a URL"),
    ("installer", "https://x.example/a.run#", "fragment"),
])
def test_source_urls_are_bounded_by_the_file_name_they_become(tmp_path, where, url, words):
    h = host()
    if where == "tarball":
        h["kernel"]["source"] = {"kind": "tarball", "url": url, "sha256": "0" * 64}
        path = "hosts.kpro6.kernel.source.url"
    else:
        h["nvidia"]["installer"]["url"] = url
        path = "hosts.kpro6.nvidia.installer.url"
    refused(tmp_path, h, path, words)


# ------------------------------------------------------------------ hosts

HOSTILE_HOSTS = ["fe80::1%x]@evil.example:443#", "fe80::1%eth0/x", "fe80::1% x", "fe80::1%" + "e" * 16,
                 "fe80::1%", "[fe80::1", "fe80::1]", "[fe80::1]", "10.0.0.1%eth0", "fe80::1%a%b", "evil.example:443"]


@pytest.mark.parametrize("value", HOSTILE_HOSTS)
@pytest.mark.parametrize("field", ["ssh.hostname", "proxmox_api.host"])
def test_a_host_is_a_host_and_a_zone_id_an_interface_name(tmp_path, field, value):
    h = host()
    section, key = field.split(".")
    h.setdefault(section, {"token_name": "pvegpu", "token_env": "PVE_TOKEN"})[key] = value
    refused(tmp_path, h, f"hosts.kpro6.{field}", "")


GOOD_HOSTS = ["fe80::1%vmbr0", "fe80::1%2", "2001:db8::1", "10.0.0.1", "kpro6.lab.internal", "kpro6"]


@pytest.mark.parametrize("value", GOOD_HOSTS + HOSTILE_HOSTS)
def test_the_url_proxmoxer_builds_has_exactly_the_spec_host(tmp_path, value):
    """proxmoxer's https backend makes its base URL from the host; the URL requests sends to
    must name exactly that host (an accepted value), or the value is refused at load."""
    pytest.importorskip("requests")
    import urllib3
    from proxmoxer.backends.https import Backend

    h = host()
    h["proxmox_api"] = {"host": value, "token_name": "pvegpu", "token_env": "PVE_TOKEN"}
    try:
        spec = accepted(tmp_path, h).proxmox_api
    except SpecError:
        assert value in HOSTILE_HOSTS
        return
    assert value in GOOD_HOSTS
    url = Backend(host=spec.host, port=spec.port, user=spec.user, token_name=spec.token_name,
                  token_value="x").get_base_url()
    parsed = urllib3.util.parse_url(url)
    assert parsed.host == (f"[{value}]" if ":" in value else value) and parsed.port == 8006 and parsed.auth is None


# ------------------------------------------------------------------ keys pydantic reads as one

@pytest.mark.parametrize("text, words", [
    ("hosts:\n  kpro6:\n    containers:\n      200: {}\n      \"200\": {}\n", "same key once read as int"),
    ("hosts:\n  kpro6:\n    containers:\n      200: {}\n      200.0: {}\n", "same key once read as int"),
    ("hosts:\n  kpro6: {}\n  !!binary a3BybzY=: {}\n", "same key once read as str"),
    ("hosts:\n  kpro6:\n    nccl:\n      overrides:\n        NCCL_DEBUG: INFO\n        !!binary TkNDTF9ERUJVRw==: WARN\n",
     "same key once read as str"),
    ("hosts:\n  kpro6: {}\n  kpro6: {}\n", "appears twice"),
])
def test_keys_that_differ_only_in_yaml_type_are_refused(tmp_path, text, words):
    msg = load_text(tmp_path, text)
    assert words in msg and "line" in msg


# ------------------------------------------------------------------ sentences, never tracebacks

@pytest.mark.parametrize("value, words", [
    ("!!int abc", "'abc' is not a valid !!int"),
    ("!!float abc", "'abc' is not a valid !!float"),
    ("!!bool maybe", "'maybe' is not a valid !!bool"),
    ("!!timestamp 2001-13-45", "not a valid !!timestamp"),
    ("!!binary a", "failed to decode base64"),
    ("9" * 4301, "more than 4300 digits"),
    ("a\x00b", "U+0000 is not allowed"),
    ("a\x07b", "U+0007 is not allowed"),
    ("a\x1bb", "U+001B is not allowed"),
    ('"\\ud800"', "lone UTF-16 surrogate"),
    ("!!python/object:os.system x", "could not determine a constructor"),
])
def test_yaml_that_raised_a_traceback_is_one_sentence_with_its_line(tmp_path, value, words):
    msg = load_text(tmp_path, f"hosts:\n  kpro6:\n    node: {value}\n")
    line = next(line for line in msg.splitlines() if words in line)
    assert "line 3" in line and "Traceback" not in msg


@pytest.mark.parametrize("value", ["a\u2028b", "a\u2029b", "a\x85b", "a\x0bb", "a\x0cb", "a\x1cb", "a\tb"])
def test_line_separators_and_control_characters_are_refused_in_every_string(tmp_path, value):
    h = host()
    h["nccl"]["overrides"] = {"NCCL_DEBUG": value}
    refused(tmp_path, h, 'hosts.kpro6.nccl.overrides["NCCL_DEBUG"]', "control characters, line separators")


# ------------------------------------------------------------------ lengths the consumer keeps

def test_kernel_version_is_a_release_uname_can_hold(tmp_path):
    h = host()
    h["kernel"]["version"] = "6.14.11-4-" + "p" * 60
    refused(tmp_path, h, "hosts.kpro6.kernel.version", "at most 64")


@pytest.mark.parametrize("value, ok", [("x" * 1023, True), ("x" * 1024, False), ("é" * 511, True), ("é" * 512, False)])
def test_nccl_values_fit_what_nccl_keeps(tmp_path, value, ok):
    h = host()
    h["nccl"]["overrides"] = {"NCCL_DEBUG": value}
    if ok:
        assert accepted(tmp_path, h).nccl.overrides["NCCL_DEBUG"] == value
    else:
        refused(tmp_path, h, 'hosts.kpro6.nccl.overrides["NCCL_DEBUG"]', "at most 1023 bytes")


def test_values_checks_raise_value_error_only():
    for check, value in [(V.git_ref, "-x"), (V.git_url, "-x"), (V.hostname_or_ip, "[x"), (V.cmdline_word, "--"),
                         (V.source_location, "https://x.example:bad/x")]:
        with pytest.raises(ValueError):
            check(value)


@pytest.mark.parametrize("key", ["key", "cert"])
def test_signing_paths_are_host_paths_like_every_other(tmp_path, key):
    h = host()
    h["nvidia"]["signing"] = {"key": "/root/mok.key", "cert": "/root/mok.der", key: "/root/../etc/shadow"}
    refused(tmp_path, h, f"hosts.kpro6.nvidia.signing.{key}", "holds '.' or '..'")
