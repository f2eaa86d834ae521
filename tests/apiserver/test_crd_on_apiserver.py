"""The BatchProfile CRD and the profiles on a real kube-apiserver v1.37.2 (issue #27, part 2).

The server compiles the CRD's structural schema and CEL rules (and refuses a rule whose estimated
cost is over its budget, which cel-python does not check), defaults, prunes, and validates each
object. Here every example applies, and every invalid case of the unit suites (the models' and the
CEL rules') is refused by the server and by ``batchpilot-operator validate`` alike: same verdict on
each case, and every field the server names is named by ``validate`` in the same run.
"""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from batchpilot_operator import GROUP, PLURAL, VERSION
from batchpilot_operator.api.crd import custom_resource_definition
from tests.support.control_plane import ControlPlane
from tests.support.factories import make_manifest, make_spec_dict

ROOT = Path(__file__).resolve().parents[2]
CRD_FILE = ROOT / "crds" / "batchpilot.dev_batchprofiles.yaml"
EXAMPLES = sorted((ROOT / "deploy" / "examples").glob("*.yaml"))
CRD_NAME = custom_resource_definition()["metadata"]["name"]

LANE = {"name": "c", "window": {"targetBatchSize": 1, "hardCap": 2, "maxWaitMs": 0}}
RESTART = {"workload": {"kind": "Deployment", "name": "chat", "container": "vllm"}}


def _restart(**fields: Any) -> dict[str, Any]:
    return make_spec_dict(engine="vllm", tuning={"mode": "restart"}, restart={**RESTART, **fields})


# Every invalid profile of tests/unit (test_crd, test_profile, test_profile_engine, test_profile_restart,
# test_profile_canary), and the issue's profile with three errors at once. Each name is the object's name.
INVALID: dict[str, dict[str, Any]] = {
    "target-above-cap": make_spec_dict(window={"targetBatchSize": 16, "hardCap": 8, "maxWaitMs": 0}),
    "target-zero": make_spec_dict(window={"targetBatchSize": 0, "hardCap": 8, "maxWaitMs": 0}),
    "negative-wait-low-ratio-cap-under-target": make_spec_dict(
        window={"targetBatchSize": 16, "hardCap": 8, "maxWaitMs": -5, "tailMarkRatio": 0.5}
    ),
    "p99-negative": make_spec_dict(slo={"p99Ms": -5}),
    "p999-under-p99": make_spec_dict(slo={"p99Ms": 800, "p999Ms": 400}),
    "slo-without-objective": make_spec_dict(slo={"latencyMetric": "ttft"}),
    "p999-without-p99": make_spec_dict(slo={"interTokenP99Ms": 40, "p999Ms": 900}),
    "unknown-latency-metric": make_spec_dict(slo={"p99Ms": 800, "latencyMetric": "tpot"}),
    "unknown-friendliness": make_spec_dict(batchFriendliness="extreme"),
    "empty-selector": make_spec_dict(selector={}),
    "cap-range-reversed": make_spec_dict(tuning={"bounds": {"hardCap": {"min": 32, "max": 8}}}),
    "ratio-range-reversed": make_spec_dict(tuning={"bounds": {"tailMarkRatio": {"min": 3.0, "max": 2.0}}}),
    "target-outside-bounds": make_spec_dict(tuning={"bounds": {"targetBatchSize": {"min": 10, "max": 20}}}),
    "wait-outside-bounds": make_spec_dict(tuning={"bounds": {"maxWaitMs": {"min": 0, "max": 10}}}),
    "prefill-range-below-default": make_spec_dict(tuning={"bounds": {"maxPrefillTokens": {"max": 100}}}),
    "step-fraction-zero": make_spec_dict(tuning={"maxStepFraction": 0}),
    "unknown-mode": make_spec_dict(tuning={"mode": "auto"}),
    "negative-cooldown-and-cap-outside-bounds": make_spec_dict(
        window={"targetBatchSize": 8, "hardCap": 16, "maxWaitMs": 20},
        tuning={"bounds": {"hardCap": {"max": 8}}, "cooldownSeconds": -1},
    ),
    "lane-bad-name": make_spec_dict(lanes=[{**LANE, "name": "Critical!"}]),
    "lane-reserves-over-cap": make_spec_dict(lanes=[{**LANE, "reservedSlots": 20}]),
    "lane-target-above-cap": make_spec_dict(
        lanes=[{"name": "c", "window": {"targetBatchSize": 4, "hardCap": 2, "maxWaitMs": 0}}]
    ),
    "lanes-repeated": make_spec_dict(lanes=[LANE, LANE]),
    "unknown-engine": make_spec_dict(engine="tgi"),
    "unknown-engine-and-target-above-cap": make_spec_dict(
        engine="tgi", window={"targetBatchSize": 16, "hardCap": 8, "maxWaitMs": 0}
    ),
    "vllm-adaptive": make_spec_dict(engine="vllm", tuning={"mode": "adaptive"}),
    "vllm-static": make_spec_dict(engine="vllm", tuning={"mode": "static"}),
    "restart-without-budget": make_spec_dict(engine="vllm", tuning={"mode": "restart"}),
    "restart-on-batchpilot": _restart() | {"engine": "batchpilot"},
    "restart-hours-equal": _restart(allowedHours={"start": "03:00", "end": "03:00"}),
    "restart-hour-24": _restart(allowedHours={"start": "24:00", "end": "03:00"}),
    "restart-per-day-zero": _restart(maxPerDay=0),
    "restart-per-day-25": _restart(maxPerDay=25),
    "restart-interval-60": _restart(minIntervalSeconds=60),
    "restart-min-change-small": _restart(minChange=0.01),
    "restart-daemonset": _restart(workload={"kind": "DaemonSet", "name": "chat", "container": "vllm"}),
    "restart-bad-workload-name": _restart(workload={"kind": "Deployment", "name": "Chat!", "container": "vllm"}),
    "llamacpp-adaptive-inter-token": make_spec_dict(
        engine="llamacpp", tuning={"mode": "adaptive"}, slo={"p99Ms": 500, "interTokenP99Ms": 50}
    ),
    "llamacpp-static-prefill-budget": make_spec_dict(
        engine="llamacpp",
        tuning={"mode": "static"},
        window={"targetBatchSize": 8, "hardCap": 16, "maxWaitMs": 40, "maxPrefillTokens": 256},
    ),
    "canary-on-static": make_spec_dict(tuning={"mode": "static", "canary": {"enabled": True}}),
    "canary-on-sglang": make_spec_dict(engine="sglang", tuning={"canary": {"enabled": True}}),
    "canary-share-small": make_spec_dict(tuning={"canary": {"enabled": True, "share": 0.05}}),
    "canary-intervals-zero": make_spec_dict(tuning={"canary": {"enabled": True, "intervals": 0}}),
    "secret-with-namespace": make_spec_dict(
        runtime={"adminTokenSecret": {"name": "tok", "key": "token", "namespace": "other"}}
    ),
    "secret-name-a-path": make_spec_dict(runtime={"adminTokenSecret": {"name": "../other/secrets/x", "key": "t"}}),
    "missing-window-and-slo": {"model": "m", "selector": {"matchLabels": {"app": "m"}}},
    "unknown-field": make_spec_dict(windw={}),
}
# The server's cause for the CEL rules it left unevaluated after a type or enum error (field <nil>).
NOT_CHECKED = "some validation rules were not checked"


@pytest.fixture(scope="module")
def api(control_plane: ControlPlane) -> Iterator[client.CustomObjectsApi]:
    control_plane.install_crd()
    api_client = config.new_client_from_config(config_file=str(control_plane.kubeconfig))
    with api_client:
        yield client.CustomObjectsApi(api_client)


@pytest.fixture(scope="module")
def namespace(control_plane: ControlPlane, api: client.CustomObjectsApi) -> str:
    return control_plane.namespace("crd")


def test_the_crd_is_established_with_its_cel_rules_under_the_cost_budget(control_plane: ControlPlane, api: Any) -> None:
    crd = control_plane.get(f"crd/{CRD_NAME}")
    conditions = {c["type"]: c["status"] for c in crd["status"]["conditions"]}
    assert conditions == {"NamesAccepted": "True", "Established": "True"}
    # The server kept every rule (a refused one would have failed the apply, naming its cost).
    served = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    assert json.dumps(served, sort_keys=True).count("x-kubernetes-validations") == json.dumps(
        custom_resource_definition()["spec"]["versions"][0]["schema"]["openAPIV3Schema"], sort_keys=True
    ).count("x-kubernetes-validations")


def _server_refusal(api: client.CustomObjectsApi, namespace: str, manifest: dict[str, Any]) -> list[str] | None:
    """None when the server accepts ``manifest`` (a dry run); else each cause it gives, ``field: message``.

    Field validation is Strict, as kubectl's default: an unknown field is refused, not silently pruned."""
    try:
        api.create_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, manifest, dry_run="All", field_validation="Strict"
        )
    except ApiException as refused:
        if refused.status not in (400, 422):
            raise AssertionError(f"{manifest['metadata']['name']}: {refused.status} {refused.body}") from refused
        body = json.loads(refused.body)
        causes = body.get("details", {}).get("causes", [])
        if not causes:  # strict field validation answers 400 with the fields in its message
            return [f"<strict>: {body.get('message', '')}"]
        return [f"{cause.get('field', '')}: {cause.get('message', '')}" for cause in causes]
    return None


def _validate_run(folder: Path) -> dict[str, str]:
    """One run of ``batchpilot-operator validate`` over ``folder``: each profile's output, by name."""
    result = subprocess.run(
        [sys.executable, "-m", "batchpilot_operator.cli.main", "validate", str(folder)],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    by_name: dict[str, str] = {}
    for line in result.stdout.splitlines():
        match = re.match(r"^(?P<source>[^:]+): (?:(?P<ns>[^/:]+)/)?(?P<name>[^:]+): (?P<rest>.*)$", line)
        assert match, f"unexpected validate line: {line!r}"
        by_name[match["name"]] = by_name.get(match["name"], "") + match["rest"] + "\n"
    return by_name


def _normal(text: str) -> str:
    """Paths compared the same way on both sides: ``spec: lanes[1].name`` (a rule at the spec, naming a
    field in its message) is ``spec.lanes[1].name``, and any list index or key is ``[]``."""
    return re.sub(r"\[[^\]]*\]", "[]", text.replace("spec: ", "spec."))


def _unnamed(cause: str, said: str) -> str | None:
    """The field a server cause names, when ``validate``'s output does not name it; None when it does.

    A cause at a field names that field; a cause at ``spec`` (a rule between fields) names the field its
    message starts with (``window.hardCap must lie within ...``); strict field validation names each
    unknown field in quotes."""
    field, _, message = cause.partition(": ")
    if field == "<strict>":
        names = re.findall(r'unknown field "([^"]+)"', message)
    elif field == "spec":
        names = ["spec." + message.removeprefix("Invalid value: ").split(" ")[0]]
    else:
        names = [field]
    missing = [name for name in names if _normal(name) not in _normal(said)]
    return ", ".join(missing) or None


def test_server_and_validate_agree_on_every_invalid_case(
    api: client.CustomObjectsApi, namespace: str, tmp_path: Path
) -> None:
    for name, spec in INVALID.items():
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(make_manifest(spec, name=name)))
    validate = _validate_run(tmp_path)
    disagreements = []
    for name, spec in INVALID.items():
        causes = _server_refusal(api, namespace, make_manifest(spec, name=name))
        said = validate.get(name, "")
        if causes is None:
            disagreements.append(f"{name}: the server accepts it; validate says {said!r}")
        elif "INVALID" not in said:
            disagreements.append(f"{name}: the server refuses {causes}; validate says {said!r}")
        else:
            for cause in causes:
                unnamed = None if NOT_CHECKED in cause else _unnamed(cause, said)
                if unnamed:
                    disagreements.append(f"{name}: the server names {unnamed} ({cause}); validate says {said!r}")
    assert disagreements == []


def test_the_issues_profile_has_all_its_errors_named_by_both_in_one_run(
    api: client.CustomObjectsApi, namespace: str, tmp_path: Path
) -> None:
    # A negative wait, a tail ratio under 1 and a cap under its target: validate used to need two runs.
    name = "negative-wait-low-ratio-cap-under-target"
    manifest = make_manifest(INVALID[name], name=name)
    causes = _server_refusal(api, namespace, manifest)
    assert causes is not None
    assert sorted(cause.partition(": ")[0] for cause in causes) == [
        "spec",
        "spec",
        "spec.window",
        "spec.window.maxWaitMs",
        "spec.window.tailMarkRatio",
    ]
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(manifest))
    said = _validate_run(tmp_path)[name]
    for part in (
        "spec.window.maxWaitMs: Input should be greater than or equal to 0",
        "spec.window.tailMarkRatio: Input should be greater than 1",
        "spec.window: targetBatchSize (16) must be less than or equal to hardCap (8)",
        "spec: window.maxWaitMs, window.tailMarkRatio must lie within tuning.bounds",
    ):
        assert part in said, said


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_applies(control_plane: ControlPlane, namespace: str, path: Path) -> None:
    manifest = yaml.safe_load(path.read_text())
    manifest["metadata"]["namespace"] = namespace
    control_plane.apply(manifest)
    served = control_plane.get("batchprofile", manifest["metadata"]["name"], namespace=namespace)
    assert served["metadata"]["generation"] == 1
    # What the example says is what is stored; the server only added defaults.
    for key, value in manifest["spec"].items():
        if isinstance(value, dict):
            assert value.items() <= served["spec"][key].items() or _contains(served["spec"][key], value), key
        else:
            assert served["spec"][key] == value, key


def _contains(served: Any, written: Any) -> bool:
    if isinstance(written, dict):
        return isinstance(served, dict) and all(k in served and _contains(served[k], v) for k, v in written.items())
    return bool(served == written)


def test_an_unknown_field_is_pruned_without_strict_field_validation(
    control_plane: ControlPlane, api: client.CustomObjectsApi, namespace: str
) -> None:
    # What a client that does not ask for strict validation gets: the field dropped, with a warning.
    manifest = make_manifest(make_spec_dict(windw={}), name="pruned", namespace=namespace)
    api.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, manifest, field_validation="Ignore")
    assert "windw" not in api.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "pruned")["spec"]


def test_status_is_a_subresource_and_generation_follows_the_spec(
    control_plane: ControlPlane, api: client.CustomObjectsApi, namespace: str
) -> None:
    manifest = make_manifest(make_spec_dict(), name="gen", namespace=namespace)
    api.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, manifest)
    status = {"window": {"targetBatchSize": 8, "hardCap": 16, "maxWaitMs": 40, "tailMarkRatio": 2.0, "generation": 3}}
    # A status written through the main resource is dropped; through /status it lands.
    api.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "gen", {"status": status})
    assert "status" not in api.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "gen")
    api.patch_namespaced_custom_object_status(GROUP, VERSION, namespace, PLURAL, "gen", {"status": status})
    stored = api.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "gen")
    assert stored["status"]["window"]["generation"] == 3 and stored["metadata"]["generation"] == 1
    changed = copy.deepcopy(stored["spec"])
    changed["window"]["maxWaitMs"] = 20
    api.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "gen", {"spec": changed})
    assert api.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "gen")["metadata"]["generation"] == 2


def test_kubectl_get_bp_shows_the_printer_columns_with_real_values(
    control_plane: ControlPlane, api: client.CustomObjectsApi, namespace: str
) -> None:
    manifest = make_manifest(make_spec_dict(model="chat"), name="cols", namespace=namespace)
    api.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, manifest)
    status = {
        "window": {"targetBatchSize": 12, "hardCap": 24, "maxWaitMs": 30, "tailMarkRatio": 2.0, "generation": 2},
        "observed": {"p99Ms": 420.5},
        "pods": {"total": 2, "ready": 2, "synced": 1, "summary": "1/2"},
        "mode": "adaptive",
        "conditions": [
            {
                "type": "Synced",
                "status": "True",
                "reason": "Pushed",
                "message": "1/1 pods",
                "lastTransitionTime": "2026-12-03T12:00:00Z",
            }
        ],
    }
    api.patch_namespaced_custom_object_status(GROUP, VERSION, namespace, PLURAL, "cols", {"status": status})
    table = control_plane.kubectl("get", "bp", "cols", "--namespace", namespace).stdout.splitlines()
    header, row = table[0].split(), table[1].split()
    assert header == ["NAME", "MODEL", "TARGET", "CAP", "WAIT", "P99", "SLO", "SYNCED", "MODE", "AGE"]
    assert row[:9] == ["cols", "chat", "12", "24", "30", "420.5", "500", "1/2", "adaptive"], row
