"""plan/build_share.py (issue 41): the build's input key per host and the grouping of a run's hosts."""

from __future__ import annotations

from plan.build_share import build_inputs, build_key, distrust_lines, kernel_build_inputs, share_lines, share_plan

REL = "6.1.0-57-amd64"
GCC = "gcc-12 (Debian 12.2.0-14+deb12u1) 12.2.0"
GXX = "g++-12 (Debian 12.2.0-14+deb12u1) 12.2.0"
SHA = "ab" * 32


def nv_state(gcc: str = GCC, gxx: str = GXX, cores: int = 2, mem: int = 8 << 20) -> dict:
    return {"cores": cores, "mem_total_kib": mem, "compilers": {"gcc-12": gcc, "g++-12": gxx},
            "releases": {REL: {"cc_version_text": "gcc-12 (Debian 12.2.0-14) 12.2.0"}}}


def share_state(headers: str | None = "linux-headers-6.1.0-57-amd64 6.1.158-1", machine: str = "x86_64",
                cluster: str | None = "c1", node: str = "a", published: dict | None = None) -> dict:
    members = None
    if cluster:
        members = {"nodename": node, "cluster": {"name": cluster},
                   "nodelist": {n: {"id": i, "online": 1, "ip": f"10.0.0.{i}"} for i, n in enumerate("abcd", 1)}}
    return {"machine": machine, "headers": {REL: headers} if headers else {}, "members": members,
            "published": published or {}}


ENTRY = {"cc": "gcc-12", "cxx": "g++-12"}


def host(node: str, cores: int = 2, mem: int = 8 << 20, gcc: str = GCC, headers="linux-headers-6.1.0-57-amd64 6.1.158-1",
         cluster: str | None = "c1", published: dict | None = None, build: bool = True, version: str = "595.45.04") -> dict:
    nv, sh = nv_state(gcc=gcc, cores=cores, mem=mem), share_state(headers=headers, cluster=cluster, node=node,
                                                                    published=published)
    builds = {}
    if build:
        inputs, why = build_inputs(version, SHA, REL, nv, sh, ENTRY)
        builds[REL] = {"version": version, "inputs": inputs, "why": why, "key": build_key(inputs) if inputs else None}
    return {"cores": cores, "mem_total_kib": mem, "members": sh["members"], "published": sh["published"],
            "builds": builds}


def test_the_key_changes_with_every_input_and_only_with_them():
    base, _ = build_inputs("595.45.04", SHA, REL, nv_state(), share_state(), ENTRY)
    assert base is not None
    same, _ = build_inputs("595.45.04", SHA, REL, nv_state(cores=64, mem=1 << 30), share_state(node="z", cluster="x"),
                           ENTRY)
    assert same is not None and build_key(same) == build_key(base)  # cores, memory, cluster: no input of the build
    variants = [
        build_inputs("595.45.05", SHA, REL, nv_state(), share_state(), ENTRY),
        build_inputs("595.45.04", "cd" * 32, REL, nv_state(), share_state(), ENTRY),
        build_inputs("595.45.04", SHA, REL, nv_state(gcc="gcc-12 (Debian 12.2.0-14+deb12u2) 12.2.0"), share_state(), ENTRY),
        build_inputs("595.45.04", SHA, REL, nv_state(gxx="g++-12 (Debian 12.2.0-15) 12.2.0"), share_state(), ENTRY),
        build_inputs("595.45.04", SHA, REL, nv_state(), share_state(headers="linux-headers-6.1.0-57-amd64 6.1.158-2"), ENTRY),
        build_inputs("595.45.04", SHA, REL, nv_state(), share_state(machine="aarch64"), ENTRY),
        build_inputs("595.45.04", SHA, REL, nv_state(), share_state(), {"cc": "gcc-12", "cxx": None}),
    ]
    keys = {build_key(v) for v, _ in variants if v is not None}
    assert len(keys) == len(variants) and build_key(base) not in keys


def test_a_build_without_a_known_headers_package_is_not_shared():
    inputs, why = build_inputs("595.45.04", SHA, REL, nv_state(), share_state(headers=None), ENTRY)
    assert inputs is None and f"no installed headers package (linux-headers-{REL}" in (why or "")


def test_one_builder_per_key_most_cores_then_memory_then_name():
    hosts = {"a": host("a"), "b": host("b", cores=8), "c": host("c", cores=8, mem=16 << 20), "d": host("d", cores=8, mem=16 << 20)}
    steps = share_plan(hosts)
    assert steps[("c", REL)]["role"] == "build" and steps[("c", REL)]["for"] == ["a", "b", "d"]
    for name in "abd":
        assert steps[(name, REL)]["role"] == "receive" and steps[(name, REL)]["from"] == "c"
        assert steps[(name, REL)]["via"] == {"node": "c", "ip": "10.0.0.3"}
    assert len({s["key"] for s in steps.values()}) == 1
    hosts["a"]["preferred"] = True  # nvidia.share_builder: the spec's choice first
    steps = share_plan(hosts)
    assert steps[("a", REL)]["for"] == ["b", "c", "d"] and "(nvidia.share_builder; key " in steps[("a", REL)]["why"]


def test_another_compiler_builds_alone_naming_the_difference():
    other = "gcc-12 (Debian 12.2.0-14+deb12u9) 12.2.0"
    steps = share_plan({"a": host("a"), "b": host("b"), "c": host("c", gcc=other)})
    assert steps[("a", REL)]["for"] == ["b"] and steps[("b", REL)]["from"] == "a"
    assert steps[("c", REL)] == {**steps[("c", REL)], "role": "build", "for": []}
    assert steps[("c", REL)]["why"] == ("builds alone: its compiler gcc-12 '(Debian 12.2.0-14+deb12u9) 12.2.0' is not "
                                        "a, b's gcc-12 '(Debian 12.2.0-14+deb12u1) 12.2.0'")
    lines = share_lines(steps)
    assert "a: nvidia 595.45.04 for 6.1.0-57-amd64: builds for b too" in lines[0]
    assert lines[1].startswith("b: nvidia 595.45.04 for 6.1.0-57-amd64: receives the build of a (same inputs, key ")
    assert lines[1].endswith("node to node over the cluster's root SSH trust (a, 10.0.0.1)")
    assert lines[2].startswith("c: nvidia 595.45.04 for 6.1.0-57-amd64: builds alone: its compiler")


def test_hosts_of_no_common_cluster_go_through_the_controller():
    steps = share_plan({"a": host("a", cluster="c1"), "b": host("b", cluster="c2"), "c": host("c", cluster=None)})
    assert steps[("b", REL)]["via"] is None and steps[("c", REL)]["via"] is None
    assert "through the controller (not one Proxmox cluster)" in share_lines(steps)[1]


def test_a_kept_build_of_the_key_is_received_and_built_nowhere():
    key = host("x")["builds"][REL]["key"]
    steps = share_plan({"a": host("a", build=False, published={key: [REL]}), "b": host("b"), "c": host("c")})
    assert {n: (s["role"], s.get("from")) for (n, _), s in steps.items()} == {
        "a": ("keep", None), "b": ("receive", "a"), "c": ("receive", "a")}
    assert steps[("b", REL)]["why"].startswith("receives the build a already keeps for these inputs")
    assert share_lines(steps)[0] == (f"a: nvidia 595.45.04 for {REL}: already has it (kept from an earlier converge's "
                                     f"build; key {key[:12]}): nobody builds; b, c receive it")


def test_a_build_its_kernel_hook_kept_is_received_and_the_plan_says_who_made_it():
    """Issue 41: the hook built nvidia for the kernel apt installed on a, under the converge's key;
    the next converge builds it nowhere, b and c take a's."""
    key = host("x")["builds"][REL]["key"]
    keeper = {**host("a", build=False, published={key: [REL]}),
              "kept": {key: {"kind": "nvidia", "version": "595.45.04", "release": REL, "built_by": "kernel-hook",
                             "trusted": True, "why": None}}}
    steps = share_plan({"a": keeper, "b": host("b"), "c": host("c")})
    assert not any(s["role"] == "build" for s in steps.values())
    assert share_lines(steps) == [
        f"a: nvidia 595.45.04 for {REL}: already has it (built by its kernel hook; key {key[:12]}): nobody builds; "
        "b, c receive it",
        f"b: nvidia 595.45.04 for {REL}: receives the build a already keeps for these inputs (key {key[:12]}), "
        "node to node over the cluster's root SSH trust (a, 10.0.0.1)",
        f"c: nvidia 595.45.04 for {REL}: receives the build a already keeps for these inputs (key {key[:12]}), "
        "node to node over the cluster's root SSH trust (a, 10.0.0.1)"]


def test_a_tampered_kept_build_is_not_trusted_and_the_plan_says_so():
    """The fact found a's kept build changed (facts.build_share parse_kept): not published, so b and
    c build (one for both), and a line says why a's was not used."""
    key = host("x")["builds"][REL]["key"]
    why = "the sha256 of nvidia-uvm.ko differs from its manifest (a module was changed)"
    keeper = {**host("a", build=False),
              "kept": {key: {"kind": "nvidia", "version": "595.45.04", "release": REL, "built_by": "kernel-hook",
                             "trusted": False, "why": why}}}
    hosts = {"a": keeper, "b": host("b"), "c": host("c")}
    steps = share_plan(hosts)
    assert {n: s["role"] for (n, _), s in steps.items()} == {"b": "build", "c": "receive"}
    assert distrust_lines(hosts) == [f"a: nvidia 595.45.04 for {REL}: its kept build (its kernel hook's, key "
                                     f"{key[:12]}) is not trusted: {why}; nobody receives it"]


def test_a_lone_build_and_an_unshareable_one_say_why():
    steps = share_plan({"a": host("a"), "b": host("b", headers=None), "c": host("c", build=False)})
    assert steps[("a", REL)]["why"] == "builds alone: no other host of this run builds nvidia 595.45.04 for 6.1.0-57-amd64"
    assert steps[("b", REL)]["role"] == "build" and steps[("b", REL)]["key"] is None
    assert "builds alone: no installed headers package" in steps[("b", REL)]["why"]
    assert ("c", REL) not in steps


# -- the kernel stage's build (the same plan, kind "kernel") ----------------------------------------

KREL = "6.1.192-pvegpu-ci"
KGCC = "gcc (Debian 12.2.0-14+deb12u1) 12.2.0"
FRAGS = ["CONFIG_64BIT=y", "CONFIG_MODULES=y"]


def k_state(gcc: str | None = KGCC, machine: str = "x86_64", config_sha: str | None = None, cluster: str | None = "c1",
            node: str = "a", published: dict | None = None) -> dict:
    return {**share_state(machine=machine, cluster=cluster, node=node, published=published), "gcc": gcc,
            "base_config_sha256": config_sha}


def k_inputs(version: str = KREL, kind: str = "tarball", source: str = SHA, base: str = "tinyconfig",
             fragments: list[str] = FRAGS, state: dict | None = None, suffix: str | None = None):
    return kernel_build_inputs(version, kind, source, base, fragments, state or k_state(), krel_suffix=suffix)


def k_host(node: str, cores: int = 2, mem: int = 8 << 20, build: bool = True, preferred: bool = False,
           **state) -> dict:
    sh = k_state(node=node, **state)
    builds = {}
    if build:
        inputs, why = k_inputs(state=sh)
        builds[KREL] = {"version": KREL, "inputs": inputs, "why": why, "key": build_key(inputs) if inputs else None}
    return {"cores": cores, "mem_total_kib": mem, "preferred": preferred, "members": sh["members"],
            "published": sh["published"], "builds": builds}


def test_the_kernel_key_changes_with_every_build_input_and_only_with_them():
    base, _ = k_inputs()
    assert base is not None and base["cc"] == ["gcc", "(Debian 12.2.0-14+deb12u1) 12.2.0"]
    same, _ = k_inputs(state=k_state(node="z", cluster="x"))
    assert same is not None and build_key(same) == build_key(base)
    running = [k_inputs(base="running", state=k_state(config_sha=c)) for c in ("aa" * 32, "bb" * 32)]
    variants = [
        k_inputs(version="6.1.192-pvegpu-ci2"), k_inputs(source="cd" * 32), k_inputs(base="defconfig"),
        k_inputs(fragments=[*FRAGS, "CONFIG_X=y"]), k_inputs(state=k_state(gcc="gcc (Debian 12.2.0-14+deb12u2) 12.2.0")),
        k_inputs(state=k_state(machine="aarch64")), k_inputs(kind="proxmox-git", source="ab" * 20, suffix="-pvegpu"),
        k_inputs(kind="proxmox-git", source="ab" * 20, suffix="-other"), *running,
    ]
    keys = {build_key(v) for v, _ in variants if v is not None}
    assert len(keys) == len(variants) and build_key(base) not in keys


def test_a_kernel_build_whose_inputs_cannot_be_read_is_not_shared():
    inputs, why = k_inputs(base="running")
    assert inputs is None and why == "its base config (the running kernel's /boot/config-<release>) could not be read"
    inputs, why = k_inputs(state=k_state(gcc=None))
    assert inputs is None and why == "the compiler's banner (gcc --version) is unknown"


def test_one_kernel_build_for_the_group_and_another_compiler_builds_alone():
    other = "gcc (Debian 12.2.0-14+deb12u9) 12.2.0"
    hosts = {"a": k_host("a"), "b": k_host("b", cores=8), "c": k_host("c", gcc=other), "d": k_host("d", build=False)}
    steps = share_plan(hosts, "kernel")
    assert steps[("b", KREL)]["role"] == "build" and steps[("b", KREL)]["for"] == ["a"]
    assert steps[("a", KREL)]["role"] == "receive" and steps[("a", KREL)]["from"] == "b"
    assert steps[("a", KREL)]["via"] == {"node": "b", "ip": "10.0.0.2"}
    assert steps[("c", KREL)]["role"] == "build" and steps[("c", KREL)]["for"] == []
    assert ("d", KREL) not in steps
    lines = share_lines(steps)
    assert lines[0].startswith(f"a: kernel {KREL}: receives the build of b (same inputs, key ")
    assert lines[0].endswith("node to node over the cluster's root SSH trust (b, 10.0.0.2)")
    assert lines[1].startswith(f"b: kernel {KREL}: builds for a too (most cores, then memory, of the hosts with these "
                               "inputs; key ")
    assert lines[2] == (f"c: kernel {KREL}: builds alone: its compiler gcc '(Debian 12.2.0-14+deb12u9) 12.2.0' is not "
                        "a, b's gcc '(Debian 12.2.0-14+deb12u1) 12.2.0'")
    hosts["a"]["preferred"] = True  # kernel.share_builder
    steps = share_plan(hosts, "kernel")
    assert steps[("a", KREL)]["for"] == ["b"] and "(kernel.share_builder; key " in steps[("a", KREL)]["why"]


def test_a_kept_kernel_build_is_received_and_a_lone_one_says_why():
    key = k_host("x")["builds"][KREL]["key"]
    steps = share_plan({"a": k_host("a", build=False, published={key: [KREL]}), "b": k_host("b", cluster=None)},
                       "kernel")
    assert steps[("b", KREL)]["role"] == "receive" and steps[("b", KREL)]["from"] == "a"
    assert share_lines(steps) == [f"a: kernel {KREL}: already has it (kept from an earlier converge's build; key "
                                  f"{key[:12]}): nobody builds; b receives it",
                                  f"b: kernel {KREL}: receives the build a already keeps for these inputs (key "
                                  f"{key[:12]}), through the controller (not one Proxmox cluster)"]
    steps = share_plan({"a": k_host("a"), "b": k_host("b", build=False)}, "kernel")
    assert steps[("a", KREL)]["why"] == f"builds alone: no other host of this run builds kernel {KREL}"
