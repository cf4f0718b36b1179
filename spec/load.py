"""Load and validate host specs from YAML, with errors a person can act on.

    >>> hosts = load_spec_file("inventories/kpro6.yml")      # {name: HostSpec}
    >>> inventory_hosts("inventories/kpro6.yml")               # [(name, pyinfra host data)]

Errors raise `SpecError`, whose message names the file, the host and the field path
(`hosts.kpro6.gpus["0000:01:00.0"].role`) and says what is allowed. Inventory files call
`inventory_hosts`, which turns a `SpecError` into a clean exit (status 2) *before* pyinfra
connects anywhere.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError

from group_data.all import PVEGPU_DEFAULTS
from spec.models import HostSpec, SpecFile

# Fields whose next path element is a key or index (rendered as ["key"] or [n]).
_KEYED = {"gpus", "containers", "vms", "nvreg", "overrides", "nccl", "params", "services", "config_fragments"}


class SpecError(Exception):
    """A spec file is invalid. `str()` is the full, human message."""

    def __init__(self, file: str | Path, problems: list[tuple[str | None, str, str]]):
        self.file = str(file)
        self.problems = problems  # (host or None, path, message)
        super().__init__(self._render())

    def _render(self) -> str:
        lines = [f"pvegpu: invalid host spec in {self.file}:"]
        for host, path, msg in self.problems:
            who = f"host {host}: " if host else ""
            lines.append(f"  - {who}{path}: {msg}")
        lines.append("Nothing was changed on any host.")
        return "\n".join(lines)


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys (YAML would silently keep the last one)."""


def _construct_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False):
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None,
                f"key {key!r} appears twice (first on line {seen[key] + 1}); each key, e.g. a GPU address, may appear once",
                key_node.start_mark,
            )
        seen[key] = key_node.start_mark.line
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _merge(defaults: Any, value: Any) -> Any:
    if isinstance(defaults, dict) and isinstance(value, dict):
        out = copy.deepcopy(defaults)
        for k, v in value.items():
            out[k] = _merge(defaults.get(k), v)
        return out
    return copy.deepcopy(value)


def _is_type_tag(part: Any) -> bool:
    # pydantic adds union-branch tags to error locations; they are not field names
    if not isinstance(part, str):
        return False
    return part in {"int", "str", "bool", "float", "none"} or part.startswith(("literal[", "function-")) or (
        part[:1].isupper() and part.endswith("Spec")
    )


def format_path(loc: tuple) -> str:
    """('hosts','kpro6','gpus','0000:01:00.0','role') -> 'hosts.kpro6.gpus["0000:01:00.0"].role'"""
    parts = [p for p in loc if not _is_type_tag(p) and p != "[key]"]
    out = ""
    keyed_next = False
    for i, part in enumerate(parts):
        if i == 1 and parts[0] == "hosts":
            out += f".{part}"
        elif keyed_next:
            out += f"[{part}]" if isinstance(part, int) else f'["{part}"]'
        else:
            out += ("." if out else "") + str(part)
        if keyed_next:
            keyed_next = False
        elif part == "nccl":  # a container's nccl is a mapping; the host's is a section
            keyed_next = i >= 2 and parts[i - 2] == "containers"
        else:
            keyed_next = part in _KEYED and not (i == 1 and parts[0] == "hosts")
    return out


def _model_at(loc: tuple) -> type[BaseModel] | None:
    """Walk the spec models along an error location to find the model that owns the last key."""
    model: Any = SpecFile
    parts = [p for p in loc if not _is_type_tag(p)]
    i = 0
    while i < len(parts) - 1:
        part = parts[i]
        if not (isinstance(model, type) and issubclass(model, BaseModel)) or part not in model.model_fields:
            return None
        ann = model.model_fields[part].annotation
        # unwrap Optional / dict / list to the model inside
        while True:
            origin = get_origin(ann)
            if origin in (dict, list):
                ann = get_args(ann)[-1]
                i += 1  # skip the key / index
                continue
            if origin is not None:  # Union / Annotated
                models = [a for a in get_args(ann) if isinstance(a, type) and issubclass(a, BaseModel)]
                if models:
                    ann = models[0]
                    continue
                inner = [a for a in get_args(ann) if get_origin(a) in (dict, list)]
                if inner:
                    ann = inner[0]
                    continue
            break
        model = ann
        i += 1
    return model if isinstance(model, type) and issubclass(model, BaseModel) else None


def _message(err: dict) -> str:
    kind = err["type"]
    msg = err["msg"]
    if kind == "extra_forbidden":
        model = _model_at(err["loc"])
        allowed = ", ".join(model.model_fields) if model else ""
        return f"unknown key {err['loc'][-1]!r} (a typo?); allowed here: {allowed}"
    if kind == "missing":
        return "is required"
    if kind == "string_type":
        return f"got {type(err.get('input')).__name__} {err.get('input')!r}; write it as a string, in quotes"
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    if kind == "literal_error":
        return f"got {err.get('input')!r}; {msg[0].lower()}{msg[1:]}"
    return msg


def validate_spec(data: Any, file: str | Path) -> dict[str, HostSpec]:
    """Validate parsed YAML (`{"hosts": {...}}`), defaults merged under each host."""
    if not isinstance(data, dict) or "hosts" not in data:
        raise SpecError(file, [(None, "hosts", "the file must have a top-level 'hosts:' mapping of host name -> spec")])
    hosts = data["hosts"]
    if isinstance(hosts, dict):
        data = {**data, "hosts": {name: _merge(PVEGPU_DEFAULTS, spec or {}) for name, spec in hosts.items()}}
    try:
        return dict(SpecFile.model_validate(data).hosts)
    except ValidationError as exc:
        problems = []
        seen_paths: set[str] = set()
        for err in exc.errors():
            loc = err["loc"]
            host = loc[1] if len(loc) > 1 and loc[0] == "hosts" else None
            base = format_path(loc)
            if base in seen_paths and err["type"] != "extra_forbidden":
                continue  # one message per field: union branches repeat the same failure
            seen_paths.add(base)
            text = _message(err)
            for line in text.split("\n"):
                if line.startswith("@"):  # cross-field errors carry their own relative path
                    rel, _, rest = line[1:].partition(": ")
                    problems.append((host, f"{base}.{rel}", rest))
                else:
                    problems.append((host, base, line))
        raise SpecError(file, problems) from None


def load_spec_file(path: str | Path) -> dict[str, HostSpec]:
    path = Path(path)
    try:
        data = yaml.load(path.read_text(), Loader=_UniqueKeyLoader)
    except FileNotFoundError:
        raise SpecError(path, [(None, "(file)", "file not found")]) from None
    except yaml.YAMLError as exc:
        raise SpecError(path, [(None, "(yaml)", str(exc).replace("\n", " "))]) from None
    return validate_spec(data, path)


def host_data(name: str, spec: HostSpec, spec_file: str | Path) -> dict[str, Any]:
    """pyinfra host data for one host: connection settings + the validated spec."""
    data: dict[str, Any] = {"pvegpu_spec": spec, "pvegpu_spec_file": str(spec_file), "pvegpu_node": spec.node or name}
    if spec.ssh:
        data.update(ssh_hostname=spec.ssh.hostname, ssh_port=spec.ssh.port, ssh_user=spec.ssh.user)
        if spec.ssh.key:
            data["ssh_key"] = spec.ssh.key
    return data


def inventory_hosts(path: str | Path, overrides: dict[str, dict] | None = None) -> list[tuple[str, dict]]:
    """Hosts for a pyinfra inventory file; exits with status 2 on an invalid spec.

    Called while pyinfra loads the inventory, i.e. before any connection: an invalid spec
    stops the run here with the message on stderr.
    """
    try:
        specs = load_spec_file(path)
    except SpecError as exc:
        print(str(exc), file=sys.stderr)
        raise SystemExit(2) from None
    out = []
    for name, spec in specs.items():
        data = host_data(name, spec, path)
        data.update((overrides or {}).get(name, {}))
        out.append((name, data))
    return out
