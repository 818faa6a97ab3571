"""Reading Kubernetes objects from YAML or JSON: one text, one file, a directory.

Parsing is strict about types: an object with a field of the wrong type is reported as a
`LoadError` naming the file and the field path (`pods.yaml: Pod default/web: spec.nodeName:
expected a string`) and skipped, while the rest of the file and of the directory still loads.
Unknown kinds are ignored with a note. The kinds read, and their apiVersions, are the parsers'
tables in `parse_core`, `parse_istio` and `parse_gateway`.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from ..errors import ConfigError
from . import parse_core, parse_gateway, parse_istio
from .decode import decode_yaml, libyaml_documents, libyaml_takes
from .fields import FieldError, Fields
from .model import KubeObject, ObjectKey, format_key, object_key
from .store import KubeStore
from .yaml_loader import NotPlainYaml, plain_documents

YAML_SUFFIXES = (".yaml", ".yml", ".json")

# kind -> (the apiVersions read, the parser)
PARSERS: dict[str, tuple[tuple[str, ...], Callable[[Fields], KubeObject]]] = {
    **parse_core.PARSERS,
    **parse_istio.PARSERS,
    **parse_gateway.PARSERS,
}


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadError:
    """One object (or file) that could not be used; the rest of the directory still loads."""

    file: str
    object: str = ""  # e.g. "Pod default/web"; empty when the whole document or file is bad
    field: str = ""
    message: str

    def __str__(self) -> str:
        parts = [self.file]
        if self.object:
            parts.append(self.object)
        if self.field:
            parts.append(self.field)
        return ": ".join(parts + [self.message])

    def as_error(self) -> ConfigError:
        source = ": ".join(p for p in (self.file, self.object, self.field) if p)
        return ConfigError(source, self.message)


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadResult:
    objects: tuple[KubeObject, ...]
    errors: tuple[LoadError, ...] = ()
    notes: tuple[str, ...] = ()

    @property
    def store(self) -> KubeStore:
        return KubeStore(self.objects)


# What PyYAML's constructors raise for tags like `!!int x`; one bad file must not stop the rest of
# the directory from loading.
_CONSTRUCTOR_ERRORS = (ValueError, IndexError, AttributeError, TypeError, RecursionError)


def parse_documents(text: str, file: str) -> LoadResult:
    """Parse one file's text (one or more `---` separated documents, or a `kind: List`)."""
    # The plain block subset that tools write is read directly (yaml_loader's docstring); a text
    # that leaves it, even in its last document, is parsed again from the start below.
    with contextlib.suppress(NotPlainYaml):
        plain = _parse_stream(plain_documents(text), file)
        assert plain is not None  # plain_documents raises no YAMLError
        return plain
    if libyaml_takes(text):
        # One document at a time: the decoded documents of a 10,000-pod file, all held at once,
        # were most of the parse's peak memory. Any YAML error goes the way below, so errors
        # (and what libyaml would get wrong) stay PyYAML's own.
        streamed = _parse_stream(libyaml_documents(text), file)
        if streamed is not None:
            return streamed
    try:
        docs = decode_yaml(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1} column {mark.column + 1}: " if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        return LoadResult(objects=(), errors=(LoadError(file=file, message=f"{where}{problem}"),))
    except _CONSTRUCTOR_ERRORS as exc:
        return _unreadable(file, exc)
    result = _parse_stream(iter(docs), file)
    assert result is not None  # a list raises nothing while iterated
    return result


def _unreadable(file: str, exc: BaseException) -> LoadResult:
    return LoadResult(objects=(), errors=(LoadError(file=file, message=f"cannot read the YAML: {exc}"),))


def _parse_stream(docs: Iterator[Any], file: str) -> LoadResult | None:
    """Objects from decoded documents as they come; None if the decoder raised a YAML error."""
    objects: list[KubeObject] = []
    errors: list[LoadError] = []
    notes: list[str] = []
    for i in itertools.count():
        try:
            doc = next(docs)
        except StopIteration:
            break
        except (yaml.YAMLError, UnicodeError):
            return None
        except _CONSTRUCTOR_ERRORS as exc:
            return _unreadable(file, exc)
        if isinstance(doc, dict) and doc.get("kind") == "List" and isinstance(doc.get("items"), list):
            expanded = doc["items"]
        elif doc is not None:
            expanded = [doc]
        else:
            continue
        for item in expanded:
            obj, error, note = parse_object(item, file, i)
            if obj is not None:
                objects.append(obj)
            if error is not None:
                errors.append(error)
            if note is not None:
                notes.append(note)
    return LoadResult(objects=tuple(objects), errors=tuple(errors), notes=tuple(notes))


def parse_object(doc: Any, file: str, index: int) -> tuple[KubeObject | None, LoadError | None, str | None]:
    where = f"document {index + 1}"
    if not isinstance(doc, dict):
        return None, LoadError(file=file, object=where, message="expected a mapping"), None
    kind, api_version = doc.get("kind"), doc.get("apiVersion")
    if not isinstance(kind, str) or not kind:
        return None, LoadError(file=file, object=where, field="kind", message="missing"), None
    if not isinstance(api_version, str) or not api_version:
        return None, LoadError(file=file, object=where, field="apiVersion", message="missing"), None
    raw_meta = doc.get("metadata")
    meta: dict[str, Any] = raw_meta if isinstance(raw_meta, dict) else {}
    name = meta.get("name") if isinstance(meta.get("name"), str) else "?"
    ns = meta.get("namespace") if isinstance(meta.get("namespace"), str) else ""
    label = f"{kind} {ns}/{name}" if ns else f"{kind} {name}"
    entry = PARSERS.get(kind)
    if entry is None or api_version not in entry[0]:
        return None, None, f"{file}: {label} ({api_version}): kind not used by the control plane, ignored"
    try:
        obj = entry[1](Fields(doc, ""))
    except FieldError as exc:
        return None, LoadError(file=file, object=label, field=exc.path, message=exc.message), None
    return obj, None, None


ParseFn = Callable[[str, str], LoadResult]  # (text, file name) -> result, like parse_documents


def load_file(file: Path, parse: ParseFn = parse_documents) -> LoadResult:
    """One file's objects; a file that cannot be read is one `LoadError`."""
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        return LoadResult(objects=(), errors=(LoadError(file=file.name, message=f"cannot read: {exc}"),))
    return parse(text, file.name)


def load_directory(path: str | Path) -> LoadResult:
    """Read every *.yaml / *.yml / *.json file directly in `path`, in name order."""
    return merge_files((file.name, load_file(file)) for file in list_files(Path(path)))


def merge_files(results: Iterable[tuple[str, LoadResult]]) -> LoadResult:
    """One snapshot from per-file results in name order; a later duplicate of an object is an error."""
    objects: list[KubeObject] = []
    errors: list[LoadError] = []
    notes: list[str] = []
    seen: dict[ObjectKey, str] = {}
    for name, result in results:
        errors.extend(result.errors)
        notes.extend(result.notes)
        for obj in result.objects:
            key = object_key(obj)
            if key in seen:
                errors.append(
                    LoadError(
                        file=name,
                        object=format_key(key),
                        message=f"duplicate of the object in {seen[key]}; the first one is kept",
                    )
                )
                continue
            seen[key] = name
            objects.append(obj)
    return LoadResult(objects=tuple(objects), errors=tuple(errors), notes=tuple(notes))


def list_files(root: Path) -> list[Path]:
    try:
        entries = sorted(root.iterdir())
    except OSError:
        return []
    return [p for p in entries if p.suffix in YAML_SUFFIXES and not p.name.startswith(".") and p.is_file()]
