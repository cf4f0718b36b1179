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
import re
import sys
from pathlib import Path
from typing import Any, get_args, get_origin

import yaml
from pydantic import BaseModel, TypeAdapter, ValidationError
from pydantic_core import ErrorDetails

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


class _SpecConstructor(yaml.constructor.SafeConstructor):
    """SafeConstructor that refuses duplicate keys (YAML would silently keep the last one) and turns
    every failure of a constructor into a YAML error at the node's line. Both loaders below build
    with it, so what a spec becomes does not depend on which parser read it."""

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        try:
            value = super().construct_object(node, deep=deep)
        except (yaml.YAMLError, SpecError, RecursionError):
            raise
        except Exception as exc:  # PyYAML's own constructors: int('abc'), bool_values['maybe'], …
            raise yaml.constructor.ConstructorError(
                None, None, f"{_scalar(node)} is not a valid {_tag_name(node.tag)} ({_reason(exc)})",
                node.start_mark) from None
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise yaml.constructor.ConstructorError(
                    None, None, "a lone UTF-16 surrogate (written as an escape like \\ud800) is no character; "
                    "no file or SSH command can hold it", node.start_mark) from None
        return value


class _UniqueKeyLoader(yaml.reader.Reader, yaml.scanner.Scanner, yaml.parser.Parser, yaml.composer.Composer,
                       _SpecConstructor, yaml.resolver.Resolver):
    """PyYAML's pure-Python SafeLoader with the spec's constructor: the reference reading."""

    def __init__(self, stream: str):
        yaml.reader.Reader.__init__(self, stream)
        yaml.scanner.Scanner.__init__(self)
        yaml.parser.Parser.__init__(self)
        yaml.composer.Composer.__init__(self)
        _SpecConstructor.__init__(self)
        yaml.resolver.Resolver.__init__(self)


# libyaml's parser (PyYAML's CParser: scanner, parser and composer in C; the resolver and the
# constructor stay PyYAML's Python ones, as in yaml.CSafeLoader) reads a spec ~10x faster.
_LIBYAML: bool = bool(getattr(yaml, "__with_libyaml__", False))
if _LIBYAML:
    class _CUniqueKeyLoader(yaml.cyaml.CParser, _SpecConstructor, yaml.resolver.Resolver):
        def __init__(self, stream: str):
            yaml.cyaml.CParser.__init__(self, stream)
            _SpecConstructor.__init__(self)
            yaml.resolver.Resolver.__init__(self)


def _scalar(node: yaml.Node) -> str:
    if isinstance(node, yaml.ScalarNode):
        text = node.value if len(node.value) <= 40 else node.value[:40] + "…"
        return repr(text)
    return "this value"


def _tag_name(tag: str) -> str:
    return "!!" + tag.rsplit(":", 1)[-1] if tag.startswith("tag:yaml.org,2002:") else tag


def _reason(exc: Exception) -> str:
    text = str(exc).split("\n", 1)[0]
    if "integer string conversion" in text:  # CPython's int() refuses more than 4300 digits
        return "a number of more than 4300 digits"
    if isinstance(exc, KeyError):  # SafeConstructor's bool_values lookup
        return "not one of the words this tag takes"
    return text[:120] if text else type(exc).__name__


# Keys pydantic reads as the same key once coerced: int 200, "200", 200.0 (guest IDs) or
# b"x" (!!binary) beside "x" (names). Each key is compared in every form it can take.
_INT_KEY = TypeAdapter(int)
_STR_KEY = TypeAdapter(str)


def _key_forms(key: Any) -> list[tuple]:
    """The key as written (first: an exact repeat is said as such), then as pydantic's int and
    str coercions read it, where they take it."""
    forms: list[tuple] = [("raw", type(key).__name__, key)]
    for kind, adapter in (("int", _INT_KEY), ("str", _STR_KEY)):
        if isinstance(key, bool):
            continue
        try:
            forms.append((kind, adapter.validate_python(key)))
        except (ValidationError, ValueError, TypeError):
            pass
    return forms


def _construct_mapping(loader: _SpecConstructor, node: yaml.MappingNode, deep: bool = False):
    seen: dict[Any, tuple[Any, int]] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        try:
            hash(key)
        except TypeError:
            raise yaml.constructor.ConstructorError(
                None, None, "a key here is a list or mapping; keys are names, numbers or PCI addresses",
                key_node.start_mark) from None
        forms = _key_forms(key)
        for form in forms:
            if form in seen:
                first, line = seen[form]
                if form[0] == "raw":
                    what = f"key {key!r} appears twice (first on line {line + 1})"
                else:
                    what = f"key {key!r} and key {first!r} (line {line + 1}) are the same key once read as {form[0]}"
                raise yaml.constructor.ConstructorError(
                    None, None, f"{what}; each key, e.g. a GPU address or guest ID, may appear once",
                    key_node.start_mark)
        seen.update((form, (key, key_node.start_mark.line)) for form in forms)
    return loader.construct_mapping(node, deep=deep)


_SpecConstructor.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


# A host spec is a few KiB and a few hundred YAML nodes; these bounds refuse, before anything
# is built from it, a file made to exhaust memory or time (aliases that multiply: "billion
# laughs"; a self-referring alias; thousands of nesting levels).
MAX_FILE_BYTES = 1 << 20
MAX_NODES = 100_000  # after expanding every alias
MAX_DEPTH = 64


def _refuse(path: Path, where: str, why: str) -> SpecError:
    return SpecError(path, [(None, where, why)])


def _check_shape(node: yaml.Node, path: Path) -> None:
    """Count the nodes `node` stands for with every alias expanded (memoized per node, so it
    costs the size of the file, not of the expansion) and its depth; refuse cycles."""
    sizes: dict[int, int] = {}
    on_path: set[int] = set()

    def walk(n: yaml.Node, depth: int) -> int:
        if id(n) in sizes:
            return sizes[id(n)]
        if id(n) in on_path:
            raise _refuse(path, "(yaml)", f"an alias on line {n.start_mark.line + 1} refers to a node that contains "
                                          "it (a structure that never ends)")
        if depth > MAX_DEPTH:
            raise _refuse(path, "(yaml)", f"nested more than {MAX_DEPTH} levels deep (line {n.start_mark.line + 1}); "
                                          "a host spec is a few levels")
        on_path.add(id(n))
        size = 1
        if isinstance(n, yaml.SequenceNode):
            size += sum(walk(child, depth + 1) for child in n.value)
        elif isinstance(n, yaml.MappingNode):
            size += sum(walk(k, depth + 1) + walk(v, depth + 1) for k, v in n.value)
        on_path.discard(id(n))
        sizes[id(n)] = size
        if size > MAX_NODES:
            raise _refuse(path, "(yaml)", f"expands to more than {MAX_NODES} values (aliases that multiply, "
                                          f"near line {n.start_mark.line + 1}); a host spec has a few hundred")
        return size

    walk(node, 0)


def _check_depth(text: str, path: Path) -> None:
    """Refuse nesting deeper than MAX_DEPTH, from the parser's events (no recursion). libyaml's
    parser (PyYAML's CSafeLoader, where built with it) gives the same events ~25x faster than the
    pure-Python one; on text it cannot parse, the pure-Python parser checks, so the refusal or the
    composer's own error (with PyYAML's wording) comes as before."""
    if _LIBYAML:
        try:
            _check_depth_events(yaml.parse(text, Loader=yaml.CSafeLoader), path)
            return
        except yaml.YAMLError:
            pass
    _check_depth_events(yaml.parse(text, Loader=yaml.SafeLoader), path)


def _check_depth_events(events, path: Path) -> None:
    depth = 0
    for event in events:
        if isinstance(event, (yaml.SequenceStartEvent, yaml.MappingStartEvent)):
            depth += 1
            if depth > MAX_DEPTH:
                raise _refuse(path, "(yaml)", f"nested more than {MAX_DEPTH} levels deep (line "
                                              f"{event.start_mark.line + 1}); a host spec is a few levels")
        elif isinstance(event, (yaml.SequenceEndEvent, yaml.MappingEndEvent)):
            depth -= 1


# Text libyaml and PyYAML read differently is read by PyYAML alone, so a spec means, and is
# refused, as it was before libyaml read specs. Found by comparing the two on yaml-test-suite's
# cases and on mutated inventories, and by reading their scanners:
# - every character PyYAML's reader refuses (controls, NUL, U+FFFE/FFFF, surrogates): it checks
#   the whole text before scanning (reader.py, Reader.check_printable), libyaml's reader the same
#   set only as far as it has read (reader.c, yaml_parser_update_buffer), so an earlier syntax
#   error would be said instead of the character;
# - tab: libyaml skips tabs between tokens in flow context and after an indicator (scanner.c,
#   yaml_parser_scan_to_next_token), PyYAML's scan_to_next_token skips only spaces;
# - U+FEFF past the first character: libyaml skips a BOM at the start of every line (same
#   function), PyYAML's scanner only at the start of the text;
# - NEL, LS, PS: line breaks to both, but not in every place to both;
# - '?': libyaml takes it inside a plain scalar in a flow collection ("[a?b]"), PyYAML starts a key;
# - '!': an empty node tagged "!" is null to PyYAML (parser.py, parse_node: implicit), "" to libyaml;
# - '%': directives ("%YAML 1.1#x", unknown ones) each takes where the other refuses;
# - '#' right after a block scalar's header ("|-#c"): a comment to libyaml, an error to PyYAML.
_PYTHON_ONLY = re.compile("[\t\x85\u2028\u2029\ufeff?!%]|[|>][-+0-9]*#")


def _libyaml_reads(text: str) -> bool:
    if not _LIBYAML or yaml.reader.Reader.NON_PRINTABLE.search(text):  # PyYAML's own set, compiled when yaml loads
        return False
    return _PYTHON_ONLY.search(text, 1 if text.startswith("\ufeff") else 0) is None


def _read_yaml(path: Path) -> Any:
    """The file's one YAML document, or SpecError with a sentence (never a traceback).

    libyaml parses it where PyYAML has libyaml and the text holds nothing the two read
    differently; a text libyaml refuses, or holding a value a constructor refuses, PyYAML's
    pure-Python parser reads again, so every refusal is said in PyYAML's words at PyYAML's line
    and column, as before (and a text only PyYAML takes is taken)."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise _refuse(path, "(file)", "file not found") from None
    except IsADirectoryError:
        raise _refuse(path, "(file)", "is a directory; name the .yml file") from None
    except OSError as exc:
        raise _refuse(path, "(file)", f"cannot be read: {exc.strerror or exc}") from None
    if len(raw) > MAX_FILE_BYTES:
        raise _refuse(path, "(file)", f"is {len(raw)} bytes; a host spec is a few KiB (at most {MAX_FILE_BYTES})")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _refuse(path, "(file)", f"is not UTF-8 text (byte {exc.start})") from None
    if _libyaml_reads(text):
        try:
            return _read_with_libyaml(text, path)
        except yaml.YAMLError:
            pass
    loader = None
    try:
        # PyYAML's reader checks the characters when the loader is made: inside the try
        loader = _UniqueKeyLoader(text)
        _check_depth(text, path)  # before composing: the composer recurses once per level
        return _construct(loader, path)
    except yaml.YAMLError as exc:
        raise _refuse(path, "(yaml)", _yaml_sentence(exc, text)) from None
    except RecursionError:
        raise _refuse(path, "(yaml)", "nested too deeply to read; a host spec is a few levels") from None
    finally:
        if loader is not None:
            loader.dispose()


def _read_with_libyaml(text: str, path: Path) -> Any:
    """The document as libyaml composes it, built by the spec's constructor; a YAMLError when
    libyaml refuses the text or a constructor a value (the caller reads it again with PyYAML)."""
    # libyaml's composer is C that recurses once per level (PyYAML's _yaml.pyx, CParser._compose_node)
    # with no recursion limit; a libyaml of PyYAML's wheels stops at 1000 levels (parser.c,
    # MAX_NESTING_LEVEL), another build may not: the depth is checked on its events first.
    _check_depth_events(yaml.parse(text, Loader=yaml.CSafeLoader), path)
    try:
        return _construct(_CUniqueKeyLoader(text), path)
    except RecursionError:
        raise _refuse(path, "(yaml)", "nested too deeply to read; a host spec is a few levels") from None


def _construct(loader: Any, path: Path) -> Any:
    node = loader.get_single_node()
    if node is None:
        raise _refuse(path, "(file)", "is empty; it needs a top-level 'hosts:' mapping of host name -> spec")
    _check_shape(node, path)
    return loader.construct_document(node)


def _yaml_sentence(exc: yaml.YAMLError, text: str) -> str:
    """PyYAML's error as one line: what is wrong and where (line, column), without its
    '<unicode string>' source name and the echoed snippet."""
    if isinstance(exc, yaml.reader.ReaderError):
        line = text.count("\n", 0, exc.position) + 1
        char = f"U+{exc.character:04X}" if isinstance(exc.character, int) else repr(exc.character)
        return f"line {line}: the character {char} is not allowed in YAML text ({exc.reason})"
    if isinstance(exc, yaml.MarkedYAMLError):
        parts = []
        for what, mark in ((exc.context, exc.context_mark), (exc.problem, exc.problem_mark)):
            if what:
                parts.append(f"{what} (line {mark.line + 1}, column {mark.column + 1})" if mark else what)
        return "; ".join(parts) or type(exc).__name__
    return " ".join(str(exc).split())


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


def _message(err: ErrorDetails) -> str:
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
    if not isinstance(data, dict):
        kind = {list: "a list", str: "a string", type(None): "nothing"}.get(type(data), type(data).__name__)
        raise SpecError(file, [(None, "(file)", f"holds {kind}, not a mapping; it needs a top-level 'hosts:' "
                                                "mapping of host name -> spec")])
    if "hosts" not in data:
        raise SpecError(file, [(None, "hosts", "the file must have a top-level 'hosts:' mapping of host name -> spec")])
    hosts = data["hosts"]
    if not isinstance(hosts, dict) or not hosts:
        raise SpecError(file, [(None, "hosts", "must be a mapping of host name -> spec with at least one host")])
    data = {**data, "hosts": {name: _merge(PVEGPU_DEFAULTS, spec or {}) for name, spec in hosts.items()}}
    try:
        return dict(SpecFile.model_validate(data).hosts)
    except ValidationError as exc:
        problems = []
        seen_paths: set[str] = set()
        for err in exc.errors():
            loc = err["loc"]
            host = str(loc[1]) if len(loc) > 1 and loc[0] == "hosts" else None  # a YAML key may be a number
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
    """The file's hosts, validated; any failure is a `SpecError` (never another exception)."""
    path = Path(path)
    try:
        return validate_spec(_read_yaml(path), path)
    except SpecError:
        raise
    except Exception as exc:  # a case the checks above do not know: still a sentence, not a traceback
        raise _refuse(path, "(file)", f"could not be checked ({type(exc).__name__}: {_reason(exc)})") from None


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
