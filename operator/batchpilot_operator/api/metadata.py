"""A BatchProfile's ``metadata`` checked as kube-apiserver checks a namespaced custom resource's.

The rules and the messages follow Kubernetes' own (``apimachinery``'s ``ValidateObjectMeta`` and
``util/validation``): a name that is a DNS-1123 subdomain, a namespace that is a DNS-1123 label, labels
of qualified-name keys and label values, annotations of qualified-name keys within 256 KiB. Each
problem is one line that names the field, and every problem is reported, not only the first.
"""

from __future__ import annotations

import re
from typing import Any

DNS1123_LABEL_MAX = 63
DNS1123_SUBDOMAIN_MAX = 253
QUALIFIED_NAME_MAX = 63
LABEL_VALUE_MAX = 63
ANNOTATIONS_MAX_BYTES = 256 * 1024  # kube-apiserver's TotalAnnotationSizeLimitB, keys and values together

_DNS1123_LABEL = "[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS1123_SUBDOMAIN = rf"{_DNS1123_LABEL}(\.{_DNS1123_LABEL})*"
_QUALIFIED_NAME = "([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]"
_LABEL_VALUE = f"({_QUALIFIED_NAME})?"

_DNS1123_LABEL_MESSAGE = (
    "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and must start "
    "and end with an alphanumeric character"
)
_DNS1123_SUBDOMAIN_MESSAGE = (
    "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and "
    "must start and end with an alphanumeric character"
)
_QUALIFIED_NAME_MESSAGE = (
    "must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character"
)
_LABEL_VALUE_MESSAGE = (
    "a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', and "
    "must start and end with an alphanumeric character"
)

SHOWN_VALUE_MAX = 64  # longer values are cut in messages: a 1 MB name must not make a 1 MB line


def _regex_error(message: str, pattern: str, *examples: str) -> str:
    """Kubernetes' ``RegexError``, to the character (its examples are joined by "',  or '", two spaces)."""
    shown = " or ".join(f"'{example}', " for example in examples)
    return f"{message} (e.g. {shown}regex used for validation is '{pattern}')"


def _matches(pattern: str, value: str) -> bool:
    return re.fullmatch(pattern, value, flags=re.ASCII) is not None


def dns1123_label_errors(value: str) -> list[str]:
    errors = []
    if len(value) > DNS1123_LABEL_MAX:
        errors.append(f"must be no more than {DNS1123_LABEL_MAX} characters")
    if not _matches(_DNS1123_LABEL, value):
        errors.append(_regex_error(_DNS1123_LABEL_MESSAGE, _DNS1123_LABEL, "my-name", "123-abc"))
    return errors


def dns1123_subdomain_errors(value: str) -> list[str]:
    errors = []
    if len(value) > DNS1123_SUBDOMAIN_MAX:
        errors.append(f"must be no more than {DNS1123_SUBDOMAIN_MAX} characters")
    if not _matches(_DNS1123_SUBDOMAIN, value):
        errors.append(_regex_error(_DNS1123_SUBDOMAIN_MESSAGE, _DNS1123_SUBDOMAIN, "example.com"))
    return errors


def qualified_name_errors(value: str) -> list[str]:
    """Kubernetes' ``IsQualifiedName``: an optional DNS subdomain prefix and '/', then a name of at most 63."""
    parts = value.split("/")
    if len(parts) == 1:
        name = parts[0]
        errors: list[str] = []
    elif len(parts) == 2:
        prefix, name = parts
        if not prefix:
            errors = ["prefix part must be non-empty"]
        else:
            errors = [f"prefix part {error}" for error in dns1123_subdomain_errors(prefix)]
    else:
        example = _regex_error(_QUALIFIED_NAME_MESSAGE, _QUALIFIED_NAME, "MyName", "my.name", "123-abc")
        return [f"a qualified name {example} with an optional DNS subdomain prefix and '/' (e.g. 'example.com/MyName')"]
    if not name:
        errors.append("name part must be non-empty")
    elif len(name) > QUALIFIED_NAME_MAX:
        errors.append(f"name part must be no more than {QUALIFIED_NAME_MAX} characters")
    if name and not _matches(_QUALIFIED_NAME, name):
        errors.append(
            "name part " + _regex_error(_QUALIFIED_NAME_MESSAGE, _QUALIFIED_NAME, "MyName", "my.name", "123-abc")
        )
    return errors


def label_value_errors(value: str) -> list[str]:
    errors = []
    if len(value) > LABEL_VALUE_MAX:
        errors.append(f"must be no more than {LABEL_VALUE_MAX} characters")
    if not _matches(_LABEL_VALUE, value):
        errors.append(_regex_error(_LABEL_VALUE_MESSAGE, _LABEL_VALUE, "MyValue", "my_value", "12345"))
    return errors


def shown(value: Any) -> str:
    """``value`` as Kubernetes quotes it in "Invalid value: ...", cut after SHOWN_VALUE_MAX characters."""
    if not isinstance(value, str):
        return type_name(value)
    if len(value) <= SHOWN_VALUE_MAX:
        return _quoted(value)
    return f'{_quoted(value[:SHOWN_VALUE_MAX])[:-1]}..." ({len(value)} characters)'


def _quoted(text: str) -> str:
    escaped = text.replace("\\", "\\\\").replace('"', '\\"')
    return '"' + "".join(c if c.isprintable() else repr(c)[1:-1] for c in escaped) + '"'


def type_name(value: Any) -> str:
    """How a YAML value's kind is named in messages."""
    names = {dict: "a mapping", list: "a list", str: "a string", bool: "a boolean", int: "a number", float: "a number"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


def _invalid(path: str, value: Any, error: str) -> str:
    return f"{path}: Invalid value: {shown(value)}: {error}"


def _string_map_problems(path: str, value: Any) -> list[str] | None:
    """The problems of a map that must hold strings to strings; None when it is one (then its rules apply)."""
    if not isinstance(value, dict):
        return [f"{path}: must be a map of string keys to string values, got {type_name(value)}"]
    problems = []
    for key, item in value.items():
        if not isinstance(key, str):
            problems.append(f"{path}: key {key!r} must be a string, got {type_name(key)}")
        elif not isinstance(item, str):
            problems.append(f"{path}[{shown(key)}]: must be a string, got {type_name(item)}")
    return problems or None


def _label_problems(labels: Any) -> list[str]:
    typed = _string_map_problems("metadata.labels", labels)
    if typed is not None:
        return typed
    problems: list[str] = []
    for key, value in labels.items():
        problems.extend(_invalid("metadata.labels", key, error) for error in qualified_name_errors(key))
        problems.extend(_invalid("metadata.labels", value, error) for error in label_value_errors(value))
    return problems


def _annotation_problems(annotations: Any) -> list[str]:
    typed = _string_map_problems("metadata.annotations", annotations)
    if typed is not None:
        return typed
    problems: list[str] = []
    for key in annotations:
        # Kubernetes checks annotation keys lowercased: an upper-case prefix passes there.
        problems.extend(_invalid("metadata.annotations", key, error) for error in qualified_name_errors(key.lower()))
    size = sum(len(key.encode()) + len(value.encode()) for key, value in annotations.items())
    if size > ANNOTATIONS_MAX_BYTES:
        problems.append(f"metadata.annotations: Too long: must have at most {ANNOTATIONS_MAX_BYTES} bytes")
    return problems


def metadata_problems(metadata: Any) -> list[str]:
    """Every problem kube-apiserver would find in a namespaced custom resource's ``metadata``, one line each."""
    if not isinstance(metadata, dict):
        if metadata is None:
            return ["metadata.name: Required value: name is required"]
        return [f"metadata: must be a mapping, got {type_name(metadata)}"]
    problems = []
    name = metadata.get("name")
    if name is None or name == "":
        problems.append("metadata.name: Required value: name is required")
    elif not isinstance(name, str):
        problems.append(f"metadata.name: must be a string, got {type_name(name)}")
    else:
        problems.extend(_invalid("metadata.name", name, error) for error in dns1123_subdomain_errors(name))
    namespace = metadata.get("namespace")
    if namespace is not None and not isinstance(namespace, str):
        problems.append(f"metadata.namespace: must be a string, got {type_name(namespace)}")
    elif namespace:  # empty or absent: the namespace the request is sent to
        problems.extend(_invalid("metadata.namespace", namespace, error) for error in dns1123_label_errors(namespace))
    if "labels" in metadata and metadata["labels"] is not None:
        problems.extend(_label_problems(metadata["labels"]))
    if "annotations" in metadata and metadata["annotations"] is not None:
        problems.extend(_annotation_problems(metadata["annotations"]))
    return problems
