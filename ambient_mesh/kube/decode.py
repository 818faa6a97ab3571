"""Which YAML decoder reads a text: the plain-subset reader, libyaml, or the bounded pure-Python
loader, chosen so that every text decodes exactly as `yaml.safe_load_all` would.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import Any

import yaml

from .. import yamlload
from .yaml_loader import FastCSafeLoader, NotPlainYaml, plain_documents

# libyaml (PyYAML's C extension) decodes about 7x faster than the pure-Python loader, but the two
# disagree on some odd input: libyaml accepts tabs and Unicode line breaks where PyYAML refuses them,
# reads a bare `!` tag as "" rather than null, takes `|#` as a block scalar header, and lets a plain
# scalar inside `{}` or `[]` run on past a `?` where PyYAML ends it (found by comparing the two
# loaders on generated text). Text that could hit one of those goes to the pure-Python loader, and
# so does everything libyaml rejects, so error positions and messages stay PyYAML's own. Both
# loaders share SafeConstructor and its resolver: timestamps, integers and the rest come out of the
# same Python code either way.
# yaml_loader.FastCSafeLoader is libyaml's SafeLoader with a memoised resolver and a direct
# constructor for plain documents; it falls back to SafeConstructor for everything else.
_CSafeLoader = FastCSafeLoader
_LIBYAML_UNSAFE_CHARS = ("\t", "\ufeff", "\x85", "\u2028", "\u2029")
_LIBYAML_UNSAFE_TAG = re.compile(r"(?<![^\s\[\]{},])!")
_LIBYAML_UNSAFE_HEADER = re.compile(r"[|>][-+0-9]*#")


def _libyaml_agrees(text: str) -> bool:
    """Whether libyaml decodes `text` exactly as the pure-Python loader would, when it accepts it."""
    if any(c in text for c in _LIBYAML_UNSAFE_CHARS):
        return False
    if "!" in text and _LIBYAML_UNSAFE_TAG.search(text):
        return False
    if "?" in text and ("{" in text or "[" in text):
        return False
    return not ("#" in text and _LIBYAML_UNSAFE_HEADER.search(text))


def libyaml_takes(text: str) -> bool:
    """Whether libyaml may decode `text`: it agrees with PyYAML there, and without aliases its
    missing alias bound does not matter."""
    return _CSafeLoader is not None and _libyaml_agrees(text) and not yamlload.may_have_aliases(text)


def libyaml_documents(text: str) -> Iterator[Any]:
    """The documents of `text` decoded by libyaml one at a time; call only when `libyaml_takes`."""
    return yaml.load_all(text, Loader=_CSafeLoader)


def decode_yaml(text: str) -> list[Any]:
    """Every document of a YAML stream, as `yaml.safe_load_all` returns them (same errors too),
    with aliases bounded by `yamlload` (libyaml is not, so it only gets alias-free text)."""
    with contextlib.suppress(NotPlainYaml):
        return list(plain_documents(text))  # the plain block subset: yaml_loader's docstring
    if libyaml_takes(text):
        try:
            return list(yaml.load_all(text, Loader=_CSafeLoader))
        except (yaml.YAMLError, UnicodeError):
            pass  # decoded again below, so the error (or the result) is PyYAML's own
    return yamlload.load_all(text)
