"""nvidia.releases: the kernel releases the driver stage builds for, validated like kernel versions."""

import pytest

from spec.load import SpecError, validate_spec


def nvidia(tmp_path, **over):
    data = {"hosts": {"h1": {"nvidia": {"version": "535.309.01", **over}}}}
    return validate_spec(data, tmp_path / "site.yml")["h1"].nvidia


def test_releases_default_to_none_and_keep_order_without_duplicates(tmp_path):
    assert nvidia(tmp_path).releases is None
    assert nvidia(tmp_path, releases=["6.1.0-57-amd64", "6.14.8-2-pve", "6.1.0-57-amd64"]).releases == \
        ["6.1.0-57-amd64", "6.14.8-2-pve"]


@pytest.mark.parametrize("releases, words", [
    (["6.1.0-57-amd64; reboot"], "not a kernel release"),
    (["../../etc"], "not a kernel release"),
    ([], "leave it out"),
])
def test_bad_releases_are_refused_with_the_field_path(tmp_path, releases, words):
    with pytest.raises(SpecError) as exc:
        nvidia(tmp_path, releases=releases)
    assert "hosts.h1.nvidia.releases" in str(exc.value) and words in str(exc.value)
