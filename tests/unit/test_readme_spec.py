"""Issue 31 part 3: README's spec reference states every field's rule, one line each.

The field paths come from spec/models.py (HostSpec and the models under it; a mapping's values
are written `name[]`, a list's items too), the rules from the README's bullet list under
"One line per field": each path must be named there in backticks, as itself, through a wildcard
(`nvidia.signing.*`, `*.sha256`) or as `.field` after a sibling (`proxmox_api.user`/`.token_name`).
"""

from __future__ import annotations

import re
import types
import typing
from pathlib import Path

from pydantic import BaseModel

from spec.models import HostSpec

README = Path(__file__).resolve().parents[2] / "README.md"


def _models_in(annotation) -> tuple[list[type[BaseModel]], bool]:
    """The models inside a field's annotation, and whether they sit in a mapping or list."""
    origin = typing.get_origin(annotation)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation], False
    if origin is typing.Annotated:
        return _models_in(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        found = [_models_in(a) for a in typing.get_args(annotation)]
        return [m for models, _ in found for m in models], any(many for _, many in found)
    if origin in (dict, list):
        models, _ = _models_in(typing.get_args(annotation)[-1])
        return models, bool(models)
    return [], False


def field_paths(model: type[BaseModel] = HostSpec, prefix: str = "") -> list[str]:
    paths = []
    for name, info in model.model_fields.items():
        models, many = _models_in(info.annotation)
        if not models:
            paths.append(prefix + name)
        for sub in models:
            paths += field_paths(sub, f"{prefix}{name}{'[]' if many else ''}.")
    return paths


def readme_rules() -> list[str]:
    """The field names the README's rule list writes (normalised: any `[…]` is `[]`)."""
    text = README.read_text()
    start = text.index("One line per field:")
    end = text.index("\n\n", text.index("\n- ", start))
    names: list[str] = []
    for line in text[start:end].splitlines():
        previous = ""
        for token in re.findall(r"`([^`]+)`", line.split(": ", 1)[0] if line.startswith("- ") else ""):
            token = re.sub(r"\[[^\]]*\]", "[]", token).removesuffix("[]")  # a list's items: the list
            if token.startswith(".") and previous:
                token = previous.rsplit(".", 1)[0] + token
            names.append(token)
            previous = token
    return names


def covered(path: str, names: list[str]) -> bool:
    return any(n == path or (n.endswith(".*") and path.startswith(n[:-1])) or (n.startswith("*.") and path.endswith(n[1:]))
               for n in names)


def test_every_spec_field_has_its_rule_in_the_readme():
    names = readme_rules()
    missing = [p for p in field_paths() if not covered(p, names)]
    assert missing == [], f"README's spec reference has no rule line for: {missing}"


def test_the_readme_names_no_field_the_models_lack():
    paths = field_paths()
    sections = {p[:m.start()] for p in paths for m in re.finditer(r"\[\]|\.", p)}  # `gpus` (its keys), `kernel.source`
    stale = [n for n in readme_rules() if "*" not in n and n not in paths and n not in sections]
    assert stale == [], f"README's rules name fields spec/models.py does not have: {stale}"


def test_field_paths_follow_the_models():
    paths = field_paths()
    assert {"ssh.hostname", "kernel.source.ref", "gpus[].role", "containers[].nccl", "nvidia.signing.key",
            "nvidia.installer.sha256", "proxmox_api.ca_file", "kernel_updates"} <= set(paths)
    assert "kernel.source" not in paths and "gpus" not in paths
