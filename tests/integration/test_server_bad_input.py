"""Bad input on every route of both apps (serving and admin): a 4xx naming the field, or the body
when no field applies, never a 5xx; and requests generated from each app's own OpenAPI schema
(conforming values, boundaries, wrong types, refused literals, other encodings), each of which ends
in a result or an explicit error."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import httpx
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from batchpilot_runtime.contract.admin_api import AdminError, WindowState, WindowUpdate
from tests.integration.runtime_process import ThreadRuntime, runtime_thread
from tests.support.server_fuzzing import (  # noqa: F401  (the runtime and serve fixtures)
    FUZZ_SETTINGS,
    check_named_refusal,
    json_values,
    runtime_fixture,
    serve_fixture,
)

INT64_MAX = 2**63 - 1
DIGITS_5000 = "9" * 5000
WINDOW = {"targetBatchSize": 2, "hardCap": 8, "maxWaitMs": 0}
LANE = {"name": "batch", "window": {"targetBatchSize": 1, "hardCap": 2, "maxWaitMs": 0}, "reservedSlots": 0}


@dataclass(frozen=True)
class Raw:
    """JSON text sent as is: what json.dumps cannot write (5,000 digits) or would not (a lone surrogate)."""

    text: str


def to_json(value: Any) -> str:
    if isinstance(value, Raw):
        return value.text
    if isinstance(value, dict):
        return "{" + ",".join(f"{json.dumps(k)}:{to_json(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(to_json(v) for v in value) + "]"
    return json.dumps(value)  # a float NaN comes out as the NaN literal, which is the point


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.fixture(scope="module")
def admin(runtime: ThreadRuntime) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=runtime.admin_url, timeout=60.0, headers=runtime.auth_headers()) as http:
        yield http


def _clients(serve: httpx.Client, admin: httpx.Client) -> dict[str, httpx.Client]:
    return {"serve": serve, "admin": admin}


# -- explicit cases ---------------------------------------------------------------------------------

# (body, the path the message starts with); the serving app's ``param`` is its first segment.
COMPLETION_CASES: dict[str, tuple[bytes, str]] = {
    "5000-digit max_tokens": (to_json({"prompt": "hi", "max_tokens": Raw(DIGITS_5000)}).encode(), "max_tokens"),
    "5000-digit negative max_tokens": (
        to_json({"prompt": "hi", "max_tokens": Raw("-" + DIGITS_5000)}).encode(),
        "max_tokens",
    ),
    "5000-digit seed": (to_json({"prompt": "hi", "seed": Raw(DIGITS_5000)}).encode(), "seed"),
    "5000-digit token id": (to_json({"prompt": [1, Raw(DIGITS_5000)]}).encode(), "prompt.1"),
    "2**64 seed": (to_json({"prompt": "hi", "seed": 2**64}).encode(), "seed"),
    "1e400 temperature": (to_json({"prompt": "hi", "temperature": Raw("1e400")}).encode(), "temperature"),
    "NaN temperature": (to_json({"prompt": "hi", "temperature": Raw("NaN")}).encode(), "temperature"),
    "Infinity top_p": (to_json({"prompt": "hi", "top_p": Raw("Infinity")}).encode(), "top_p"),
    "-Infinity seed": (to_json({"prompt": "hi", "seed": Raw("-Infinity")}).encode(), "seed"),
    "100000 nested lists as prompt": (f'{{"prompt": {nested(100_000)}}}'.encode(), "body"),
    "100000 nested lists": (nested(100_000).encode(), "body"),
    "100000 nested objects": (('{"a":' * 100_000 + "1" + "}" * 100_000).encode(), "body"),
    "500 nested lists as user": (f'{{"prompt": "hi", "user": {nested(500)}}}'.encode(), "user"),
    "invalid UTF-8": (b'{"prompt": "\xff\xfe"}', "body"),
    "Latin-1": ('{"prompt": "caf\u00e9"}'.encode("latin-1"), "body"),
    "UTF-8 with a byte-order mark": ('{"prompt": "hi"}'.encode("utf-8-sig"), "body"),
    "UTF-16 with a byte-order mark": ('{"prompt": "hi"}'.encode("utf-16"), "body"),
    "UTF-16LE": ('{"prompt": "hi"}'.encode("utf-16-le"), "body"),
    "UTF-32": ('{"prompt": "hi"}'.encode("utf-32"), "body"),
    "lone surrogate in prompt": (b'{"prompt": "\\ud800"}', "prompt"),
    "lone surrogate in a stop string": (b'{"prompt": "hi", "stop": ["a", "\\udc00"]}', "stop.1"),
    "lone surrogate in user": (b'{"prompt": "hi", "user": "x\\udfff"}', "user"),
    "lone surrogate as a member name": (b'{"prompt": "hi", "\\ud800": 1}', "body"),
}
HI = [{"role": "user", "content": "hi"}]
CHAT_CASES: dict[str, tuple[bytes, str]] = {
    "5000-digit max_completion_tokens": (
        to_json({"messages": HI, "max_completion_tokens": Raw(DIGITS_5000)}).encode(),
        "max_completion_tokens",
    ),
    "5000-digit seed": (to_json({"messages": HI, "seed": Raw(DIGITS_5000)}).encode(), "seed"),
    "NaN temperature": (to_json({"messages": HI, "temperature": Raw("NaN")}).encode(), "temperature"),
    "1e400 top_p": (to_json({"messages": HI, "top_p": Raw("1e400")}).encode(), "top_p"),
    "NaN presence_penalty": (to_json({"messages": HI, "presence_penalty": Raw("NaN")}).encode(), "presence_penalty"),
    "100000 nested lists as messages": (f'{{"messages": {nested(100_000)}}}'.encode(), "body"),
    "500 nested lists as content": (
        to_json({"messages": [{"role": "user", "content": Raw(nested(500))}]}).encode(),
        "messages.0.content.0",
    ),
    "invalid UTF-8": (b'{"messages": [{"role": "user", "content": "\xff"}]}', "body"),
    "UTF-16 with a byte-order mark": (json.dumps({"messages": HI}).encode("utf-16"), "body"),
    "lone surrogate in content": (b'{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages.0.content"),
    "lone surrogate in a text part": (
        b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]}',
        "messages.0.content.0.text",
    ),
    "lone surrogate as a member name": (b'{"messages": [], "\\ud800": 1}', "body"),
}
WINDOW_CASES: dict[str, tuple[bytes, str]] = {
    "5000-digit targetBatchSize": (
        to_json({"window": {**WINDOW, "targetBatchSize": Raw(DIGITS_5000)}}).encode(),
        "window.targetBatchSize",
    ),
    # Before the decoder refused it, this one was applied, then killed the engine thread converting
    # the generation to a float gauge.
    "400-digit generation": (
        to_json({"window": {**WINDOW, "generation": Raw("9" * 400)}}).encode(),
        "window.generation",
    ),
    "5000-digit generation": (
        to_json({"window": {**WINDOW, "generation": Raw(DIGITS_5000)}}).encode(),
        "window.generation",
    ),
    "2**63 generation": (to_json({"window": {**WINDOW, "generation": 2**63}}).encode(), "window.generation"),
    "5000-digit maxPrefillTokens": (
        to_json({"window": {**WINDOW, "maxPrefillTokens": Raw(DIGITS_5000)}}).encode(),
        "window.maxPrefillTokens",
    ),
    "5000-digit reservedSlots": (
        to_json({"window": WINDOW, "lanes": [{**LANE, "reservedSlots": Raw(DIGITS_5000)}]}).encode(),
        "lanes.0.reservedSlots",
    ),
    "NaN tailMarkRatio": (
        to_json({"window": {**WINDOW, "tailMarkRatio": Raw("NaN")}}).encode(),
        "window.tailMarkRatio",
    ),
    "Infinity tailMarkRatio": (
        to_json({"window": {**WINDOW, "tailMarkRatio": Raw("Infinity")}}).encode(),
        "window.tailMarkRatio",
    ),
    "1e400 tailMarkRatio": (
        to_json({"window": {**WINDOW, "tailMarkRatio": Raw("1e400")}}).encode(),
        "window.tailMarkRatio",
    ),
    "100000 nested lists as window": (f'{{"window": {nested(100_000)}}}'.encode(), "body"),
    "100000 nested lists": (nested(100_000).encode(), "body"),
    "invalid UTF-8": (b'{"window": "\xff"}', "body"),
    "UTF-8 with a byte-order mark": (json.dumps({"window": WINDOW}).encode("utf-8-sig"), "body"),
    "UTF-16 with a byte-order mark": (json.dumps({"window": WINDOW}).encode("utf-16"), "body"),
    "UTF-16LE": (json.dumps({"window": WINDOW}).encode("utf-16-le"), "body"),
    "lone surrogate in a lane name": (
        to_json({"window": WINDOW, "lanes": [{**LANE, "name": Raw('"\\ud800"')}]}).encode(),
        "lanes.0.name",
    ),
}
BODY_CASES = {
    ("serve", "POST", "/v1/completions"): COMPLETION_CASES,
    ("serve", "POST", "/v1/chat/completions"): CHAT_CASES,
    ("admin", "PUT", "/admin/window"): WINDOW_CASES,
}
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
CONTENT_TYPES = ["application/json", "text/plain", "application/x-www-form-urlencoded", ""]


def _named(app: str, response: httpx.Response) -> tuple[str, str | None]:
    """(the message, the field it names) of a refusal, in either app's error shape."""
    if app == "admin":
        return AdminError.model_validate(response.json()).detail, None
    error = response.json()["error"]
    return error["message"], error["param"]


def _routes(client: httpx.Client) -> list[tuple[str, str, bool]]:
    """(method, path, takes a body) of every operation in the app's schema, and the schema's own route."""
    schema = client.get("/openapi.json").json()
    routes = [("GET", "/openapi.json", False)]
    for path, operations in schema["paths"].items():
        routes += [(method.upper(), path, "requestBody" in op) for method, op in operations.items()]
    return routes


def test_every_route_with_a_body_has_cases(serve: httpx.Client, admin: httpx.Client) -> None:
    with_body = {(app, m, p) for app, c in _clients(serve, admin).items() for m, p, body in _routes(c) if body}
    assert with_body == set(BODY_CASES)


@pytest.mark.parametrize(
    ("route", "case"), [(route, case) for route, cases in BODY_CASES.items() for case in cases], ids=str
)
def test_bad_body_is_4xx_naming_the_field(
    serve: httpx.Client, admin: httpx.Client, route: tuple[str, str, str], case: str
) -> None:
    app, method, path = route
    body, field_path = BODY_CASES[route][case]
    before = admin.get("/admin/window").json()
    response = _clients(serve, admin)[app].request(
        method, path, content=body, headers={"content-type": "application/json"}
    )
    assert response.status_code == (422 if app == "admin" else 400), response.text[:300]
    message, param = _named(app, response)
    assert message.startswith(f"{field_path}: "), message
    if app == "serve":
        assert param == field_path.split(".")[0]
    assert admin.get("/admin/window").json() == before


@pytest.mark.parametrize("content_type", CONTENT_TYPES)
@pytest.mark.parametrize("route", list(BODY_CASES), ids=str)
def test_content_type_is_not_what_refuses(
    serve: httpx.Client, admin: httpx.Client, route: tuple[str, str, str], content_type: str
) -> None:
    # Bodies are read as JSON whatever they are labelled (curl -d sends form-urlencoded): a bad one
    # is refused for what it holds.
    app, method, path = route
    body, field_path = next(iter(BODY_CASES[route].values()))
    response = _clients(serve, admin)[app].request(method, path, content=body, headers={"content-type": content_type})
    assert 400 <= response.status_code < 500
    assert _named(app, response)[0].startswith(f"{field_path}: ")


def test_body_less_routes_ignore_bad_bodies(serve: httpx.Client, admin: httpx.Client) -> None:
    kinds = ("5000-digit", "100000 nested lists", "invalid UTF-8", "UTF-16 with", "NaN", "lone surrogate in")
    bodies = [body for case, (body, _) in COMPLETION_CASES.items() if case.startswith(kinds)]
    assert len(bodies) >= len(kinds)
    for app, client in _clients(serve, admin).items():
        for method, path, takes_body in _routes(client):
            if takes_body:
                continue
            for body in bodies:
                response = client.request(method, path, content=body, headers={"content-type": "application/json"})
                assert response.status_code == 200, (app, method, path, response.text[:200])


def test_runtime_is_whole_after_bad_input(runtime: ThreadRuntime, serve: httpx.Client, admin: httpx.Client) -> None:
    # On its own this checks a fresh runtime, which must also hold.
    assert runtime.ctx.loaded.engine.is_alive()
    assert serve.get("/readyz").json() == {"ready": True}
    assert serve.get("/metrics").status_code == 200
    assert serve.post("/v1/completions", json={"prompt": "still here", "max_tokens": 3}).status_code == 200
    generation = WindowState.model_validate(admin.get("/admin/window").json()).window.generation
    applied = admin.put("/admin/window", json={"window": {**WINDOW, "generation": generation + 1}})
    assert applied.status_code == 200, applied.text


# -- requests generated from the apps' OpenAPI schemas ----------------------------------------------

JSON_VALUES = json_values(text_size=12, key_size=8, collection_size=4, max_leaves=8)
REFUSED_LITERALS = st.sampled_from(
    [
        Raw(DIGITS_5000),
        Raw("-" + DIGITS_5000),
        Raw("9" * 400),
        Raw(str(2**63)),
        Raw("1e400"),
        Raw("NaN"),
        Raw("-Infinity"),
    ]
)


# The CEL rules the window schema carries are of this form (targetBatchSize <= hardCap).
ORDER_RULE = re.compile(r"self\.(\w+) <= self\.(\w+)")


def _in_order(body: dict[str, Any], low_key: str, high_key: str) -> dict[str, Any]:
    if low_key in body and high_key in body and body[low_key] > body[high_key]:
        return {**body, low_key: body[high_key], high_key: body[low_key]}
    return body


class SchemaStrategies:
    """Hypothesis strategies for the values one request-body JSON schema allows and refuses."""

    def __init__(self, document: dict[str, Any]) -> None:
        # Nested models are in the document's components (server/openapi_doc.py), not under $defs.
        self.defs: dict[str, Any] = document.get("components", {}).get("schemas", {})

    def resolve(self, schema: dict[str, Any]) -> dict[str, Any]:
        while "$ref" in schema:
            schema = self.defs[schema["$ref"].rsplit("/", 1)[-1]]
        return schema

    def conforming(self, schema: dict[str, Any]) -> st.SearchStrategy[Any]:
        """Values of the schema, weighted to its boundaries; small numbers where it has no bound
        above, so that conforming completions stay short."""
        schema = self.resolve(schema)
        if "const" in schema:
            return st.just(schema["const"])
        if "enum" in schema:
            return st.sampled_from(schema["enum"])
        if "anyOf" in schema:
            return st.one_of([self.conforming(s) for s in schema["anyOf"]])
        kind = schema.get("type")
        if kind == "null":
            return st.none()
        if kind == "boolean":
            return st.booleans()
        if kind == "integer":
            low = int(schema.get("minimum", -16)) + (1 if "exclusiveMinimum" in schema else 0)
            high = int(schema["maximum"]) if "maximum" in schema else INT64_MAX
            small = st.integers(low, min(high, low + 16))
            return st.one_of(small, small, small, st.sampled_from([low, high]))  # a bound one draw in four
        if kind == "number":
            low, high = schema.get("minimum", schema.get("exclusiveMinimum", -1e6)), schema.get("maximum", 1e6)
            bounds = [b for b in (low, high) if not ("exclusiveMinimum" in schema and b == low)]
            return st.floats(low, high, exclude_min="exclusiveMinimum" in schema) | st.sampled_from(bounds)
        if kind == "string":
            low, high = schema.get("minLength", 0), schema.get("maxLength")
            text = st.text(min_size=low, max_size=min(high or 40, 40))
            if high is not None and high <= 300:
                text |= st.just("x" * high)
            return text
        if kind == "array":
            high = min(schema.get("maxItems", 6), 6)
            return st.lists(self.conforming(schema.get("items", {})), min_size=schema.get("minItems", 0), max_size=high)
        if kind == "object":
            properties = schema.get("properties", {})
            required = set(schema.get("required", ()))
            members = st.fixed_dictionaries(
                {k: self.conforming(v) for k, v in properties.items() if k in required},
                optional={k: self.conforming(v) for k, v in properties.items() if k not in required},
            )
            for rule in schema.get("x-kubernetes-validations", ()):
                if (ordered := ORDER_RULE.fullmatch(rule["rule"])) is not None:
                    low_key, high_key = ordered.groups()
                    members = members.map(partial(_in_order, low_key=low_key, high_key=high_key))
            return members
        return JSON_VALUES

    def violating(self, schema: dict[str, Any]) -> st.SearchStrategy[Any]:
        """Values the schema refuses: just past each bound, of another type, literals the decoder
        refuses, a required member dropped, a member unknown, or one member violating its schema."""
        schema = self.resolve(schema)
        if "anyOf" in schema:
            members = [self.resolve(s) for s in schema["anyOf"]]
            return st.one_of([self.violating(m) for m in members if m.get("type") != "null"] or [JSON_VALUES])
        kind = schema.get("type")
        if kind == "object":
            return self._violating_object(schema)
        past: list[Any] = []
        if "const" in schema:
            past.append(not schema["const"] if isinstance(schema["const"], bool) else [schema["const"]])
        if kind in ("integer", "number"):
            past += [schema["minimum"] - 1] if "minimum" in schema else []
            past += [schema["exclusiveMinimum"]] if "exclusiveMinimum" in schema else []
            past += [schema["maximum"] + 1] if "maximum" in schema else []
            past += ["1", True, 1.5] if kind == "integer" else ["1.0", True]
        elif kind == "string":
            past += [1, Raw('"\\ud800"')]
            past += ["x" * (schema["maxLength"] + 1)] if schema.get("maxLength", 10**9) <= 300 else []
            past += [""] if schema.get("minLength", 0) > 0 else []
        elif kind == "array":
            past += [[]] if schema.get("minItems", 0) > 0 else []
            past += [[Raw(DIGITS_5000)], "not a list"]
        elif kind == "boolean":
            past += ["true", 1]
        return (st.sampled_from(past) if past else st.nothing()) | REFUSED_LITERALS | JSON_VALUES

    def _violating_object(self, schema: dict[str, Any]) -> st.SearchStrategy[Any]:
        properties = schema.get("properties", {})
        whole = self.conforming(schema)
        ways: list[st.SearchStrategy[Any]] = [st.sampled_from([[], "object", 1, None]) | REFUSED_LITERALS]
        if properties:
            ways.append(
                st.tuples(whole, st.sampled_from(sorted(properties))).flatmap(
                    lambda pair: self.violating(properties[pair[1]]).map(lambda bad: {**pair[0], pair[1]: bad})
                )
            )
        if schema.get("required"):
            ways.append(
                st.tuples(whole, st.sampled_from(schema["required"])).map(
                    lambda pair: {k: v for k, v in pair[0].items() if k != pair[1]}
                )
            )
        if schema.get("additionalProperties") is False:
            ways.append(whole.map(lambda body: {**body, "surprise": 1}))
        return st.one_of(ways)


Operation = tuple[str, str, st.SearchStrategy[Any] | None]  # method, path, body values (None: no body)
ENCODINGS = st.sampled_from(["utf-8"] * 8 + ["utf-8-sig", "utf-16", "utf-32"])


def _operations(client: httpx.Client) -> list[Operation]:
    """Each operation of the app's schema, with values conforming to or violating its request schema."""
    schema = client.get("/openapi.json").json()
    operations: list[Operation] = []
    for path, methods in schema["paths"].items():
        for method, operation in methods.items():
            body_schema = operation.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema")
            if body_schema is None:
                operations.append((method.upper(), path, None))
            else:
                strategies = SchemaStrategies(schema)
                operations.append(
                    (method.upper(), path, strategies.conforming(body_schema) | strategies.violating(body_schema))
                )
    return operations


CONTENT_TYPE_HEADERS = st.sampled_from(
    [{"content-type": "application/json"}] * 4 + [{"content-type": t} for t in CONTENT_TYPES[1:]] + [{}]
)


def _check_completion(response: httpx.Response, payload: bytes) -> None:
    if response.headers["content-type"].startswith("text/event-stream"):
        assert payload.rstrip().endswith(b"data: [DONE]")
        events = [json.loads(line[6:]) for line in payload.splitlines() if line.startswith(b"data: {")]
        assert events[-1].get("error") or any(c.get("finish_reason") for e in events for c in e.get("choices", ()))
    else:
        assert json.loads(payload)["choices"][0]["finish_reason"] in ("length", "stop")


@pytest.fixture(scope="module")
def serving_operations(serve: httpx.Client) -> list[Operation]:
    return _operations(serve)


@pytest.mark.slow
@settings(FUZZ_SETTINGS, max_examples=80)
@given(data=st.data(), headers=CONTENT_TYPE_HEADERS)
def test_serving_schema_requests_end_in_a_result_or_an_explicit_error(
    serve: httpx.Client, serving_operations: list[Operation], data: st.DataObject, headers: dict[str, str]
) -> None:
    method, path, values = data.draw(st.sampled_from(serving_operations), label="operation")
    body = b"" if values is None else to_json(data.draw(values, label="body")).encode(data.draw(ENCODINGS))
    with serve.stream(method, path, content=body, headers=headers) as response:
        payload = response.read()
    event(f"{method} {path} -> {response.status_code}")
    assert response.status_code < 500, payload[:500]
    if path not in GENERATION_PATHS:
        assert response.status_code == 200
    elif response.status_code == 200:
        _check_completion(response, payload)
    else:
        check_named_refusal(payload)


@pytest.fixture(scope="module")
def admin_fuzzed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ThreadRuntime]:
    """A runtime of its own: the windows the admin fuzzing applies (a 60 s wait, the last generation)
    would slow or freeze the other tests' runtime."""
    with runtime_thread(tmp_path_factory.mktemp("admin-fuzz"), max_model_len=512) as started:
        yield started


@pytest.fixture(scope="module")
def admin_fuzzed_client(admin_fuzzed: ThreadRuntime) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=admin_fuzzed.admin_url, timeout=60.0) as http:
        yield http


@pytest.fixture(scope="module")
def admin_operations(admin_fuzzed_client: httpx.Client) -> list[Operation]:
    return _operations(admin_fuzzed_client)


# A refusal's detail starts with the field it is about (the body's members, or "surprise", the
# unknown member the strategies add), or with "generation" for a 409.
_ADMIN_FIELD = re.compile(r"^(body|window|lanes|surprise|generation)\b")


@pytest.mark.slow
@settings(FUZZ_SETTINGS, max_examples=60)
@given(data=st.data(), headers=CONTENT_TYPE_HEADERS, authorized=st.sampled_from([True] * 5 + [False]))
def test_admin_schema_requests_end_in_a_result_or_an_explicit_error(
    admin_fuzzed: ThreadRuntime,
    admin_fuzzed_client: httpx.Client,
    admin_operations: list[Operation],
    data: st.DataObject,
    headers: dict[str, str],
    authorized: bool,
) -> None:
    method, path, values = data.draw(st.sampled_from(admin_operations), label="operation")
    value = None if values is None else data.draw(values, label="body")
    if isinstance(value, dict) and isinstance(value.get("window"), dict) and data.draw(st.booleans()):
        # Follow the protocol as the operator does, so that some updates are applied: the next generation.
        known = admin_fuzzed_client.get(path, headers=admin_fuzzed.auth_headers())
        in_force = WindowState.model_validate(known.json()).window.generation
        value = {**value, "window": {**value["window"], "generation": min(in_force + 1, INT64_MAX)}}
    body = b"" if values is None else to_json(value).encode(data.draw(ENCODINGS))
    auth = admin_fuzzed.auth_headers() if authorized else {}
    response = admin_fuzzed_client.request(method, path, content=body, headers={**headers, **auth})
    event(f"{method} {path} -> {response.status_code}")
    assert response.status_code < 500, response.text[:500]
    if method == "GET":
        assert response.status_code == (200 if authorized else 401)
    elif response.status_code == 200:
        sent = WindowUpdate.model_validate_json(body)
        assert WindowState.model_validate(response.json()).window == sent.window
    elif not authorized:
        assert response.status_code == 401
    else:
        assert response.status_code in (409, 422)
        detail = AdminError.model_validate(response.json()).detail
        assert _ADMIN_FIELD.match(detail), detail


def test_admin_fuzzed_runtime_is_whole(admin_fuzzed: ThreadRuntime) -> None:
    # Runs after the admin fuzzing in file order; on its own it checks a fresh runtime.
    assert admin_fuzzed.ctx.loaded.engine.is_alive()
    assert httpx.get(f"{admin_fuzzed.serve_url}/readyz", timeout=30.0).json() == {"ready": True}
    assert httpx.get(f"{admin_fuzzed.serve_url}/metrics", timeout=30.0).status_code == 200
    window = httpx.get(f"{admin_fuzzed.admin_url}/admin/window", headers=admin_fuzzed.auth_headers(), timeout=30.0)
    assert window.status_code == 200
