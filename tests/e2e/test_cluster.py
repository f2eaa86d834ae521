"""End to end on the test control plane: install the chart, run what it deploys, wait for Synced.

The cluster is the session's real kube-apiserver v1.37.2 and etcd (the ``control_plane`` fixture,
RBAC on). It has no kubelet, so no image is pulled and no container runs; the test plays the
hollow node (tests/support/hollow.py):

- the operator runs as ``batchpilot-operator run`` with the operator Deployment's own args, signed
  in with a TokenRequest token of the chart's ServiceAccount and nothing else: only the chart's
  RBAC binds it;
- the runtime Deployment's Pod is created from its template, and reported Running and Ready at a
  loopback address where the test runs ``batchpilot-runtime`` with that container's own args (and
  the chart's admin-token Secret, read from the server, as its mounted token file).

What a kubelet-less server cannot do, this does not claim: ``helm install --wait`` (no Deployment
becomes available) and ``helm test`` (its hook Pod never runs) are left out.
"""

from __future__ import annotations

import base64
import json
import re
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.deploy.tools import CHART
from tests.support.control_plane import ControlPlane
from tests.support.factories import make_manifest, make_spec_dict
from tests.support.hollow_release import (
    SERVE_PORT,
    HollowOperator,
    HollowRuntime,
    admin_token_file,
    helm,
    start_operator,
    start_runtime,
    stop_process,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(600)]

RELEASE = "bp-e2e"
OPERATOR = f"{RELEASE}-batchpilot-operator"
PROFILE = f"{RELEASE}-batchpilot-tiny"
TOKEN_SECRET = f"{RELEASE}-batchpilot-admin-token"
SYNCED_TIMEOUT_S = 120.0
WATCH_CHECK_S = 3


def _values() -> dict[str, Any]:
    return {
        # No Prometheus here: static mode pushes without metrics.
        "operator": {"prometheusUrl": "http://127.0.0.1:9/"},
        "runtime": {"kvCacheTokens": 4096, "terminationGracePeriodSeconds": 10},
        "models": [
            {
                "name": "tiny",
                "preset": "tiny",
                "replicas": 1,
                "profile": {
                    "tuning": {"mode": "static"},
                    "window": {"targetBatchSize": 4, "hardCap": 8, "maxWaitMs": 10, "tailMarkRatio": 2.0},
                },
            }
        ],
        "networkPolicy": {"enabled": True},
    }


@dataclass
class Release:
    namespace: str
    operator: HollowOperator
    runtime: HollowRuntime


@pytest.fixture(scope="module")
def release(control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Release]:
    plane = control_plane
    work = tmp_path_factory.mktemp("e2e")
    namespace = plane.namespace("bp-e2e")
    values = work / "values.yaml"
    values.write_text(yaml.safe_dump(_values()))
    helm(plane, "install", RELEASE, CHART, "--namespace", namespace, "--values", values)
    token_file = admin_token_file(plane, namespace, TOKEN_SECRET, work / "admin-token")
    runtime = start_runtime(plane, namespace, PROFILE, token_file, work / "runtime.log")
    # A watch check every 3 s instead of 60 s, so that an etcd outage shows in liveness within seconds.
    operator = start_operator(plane, namespace, OPERATOR, token_file, work, f"--watch-check={WATCH_CHECK_S}")
    try:
        yield Release(namespace, operator, runtime)
    finally:
        stop_process(operator.process)
        stop_process(runtime.process)
        helm(plane, "uninstall", RELEASE, "--namespace", namespace, check=False)


def _condition(profile: dict[str, Any], kind: str) -> dict[str, Any] | None:
    for condition in profile.get("status", {}).get("conditions", []):
        if condition["type"] == kind:
            return condition  # type: ignore[no-any-return]
    return None


def _wait_for_synced(plane: ControlPlane, release: Release) -> dict[str, Any]:
    deadline = time.monotonic() + SYNCED_TIMEOUT_S
    profile: dict[str, Any] = {}
    while time.monotonic() < deadline:
        assert release.operator.process.poll() is None, f"the operator exited:\n{release.operator.text()[-4000:]}"
        profile = plane.get("batchprofile", PROFILE, namespace=release.namespace)
        synced = _condition(profile, "Synced")
        if synced and synced["status"] == "True" and profile["status"].get("pods", {}).get("synced", 0) >= 1:
            return profile
        time.sleep(1)  # polling the API server for a condition, not waiting blindly
    raise AssertionError(
        f"BatchProfile {PROFILE} not Synced within {SYNCED_TIMEOUT_S:.0f} s: {profile.get('status')}\n"
        f"{release.operator.text()[-4000:]}"
    )


def test_profile_becomes_synced_and_runtime_has_its_window(control_plane: ControlPlane, release: Release) -> None:
    profile = _wait_for_synced(control_plane, release)
    window = profile["status"]["window"]
    assert (window["targetBatchSize"], window["hardCap"], window["maxWaitMs"]) == (4, 8, 10)
    # The runtime itself reports the window in force. Read at the pod's IP: the API server's pod proxy
    # answers "address not allowed" for a loopback pod IP (it never proxies to its own host's loopback).
    refused = control_plane.kubectl(
        "get", "--raw", f"/api/v1/namespaces/{release.namespace}/pods/{release.runtime.pod}:{SERVE_PORT}/proxy/metrics",
        check=False,
    )  # fmt: skip
    assert "address not allowed" in refused.stderr
    metrics = httpx.get(f"http://{release.runtime.ip}:{SERVE_PORT}/metrics", timeout=10).text
    assert any(
        line.startswith("batchpilot_window_hard_cap") and line.rstrip().endswith(" 8.0")
        for line in metrics.splitlines()
    ), "runtime does not report hardCap 8"


def test_the_operator_is_never_refused_by_rbac(control_plane: ControlPlane, release: Release) -> None:
    _wait_for_synced(control_plane, release)
    log = release.operator.text()
    refused = [line for line in log.splitlines() if " 403" in line or "Forbidden" in line or "forbidden" in line]
    assert refused == [], "\n".join(refused)
    # It signed in as the chart's ServiceAccount, with nothing but the chart's RBAC behind it.
    whoami = json.loads(
        control_plane.kubectl("auth", "whoami", "-o", "json", kubeconfig=release.operator.kubeconfig).stdout
    )
    assert whoami["status"]["userInfo"]["username"] == f"system:serviceaccount:{release.namespace}:{OPERATOR}"


def test_admin_token_survives_an_upgrade(control_plane: ControlPlane, release: Release) -> None:
    def token() -> str:
        secret = control_plane.get("secret", TOKEN_SECRET, namespace=release.namespace)
        return base64.b64decode(secret["data"]["token"]).decode()

    before = token()
    helm(control_plane, "upgrade", RELEASE, CHART, "--namespace", release.namespace, "--reuse-values")
    assert token() == before
    _wait_for_synced(control_plane, release)


SECURITY_MODEL = Path(__file__).resolve().parents[2] / "docs" / "security-model.md"


def _can_i(plane: ControlPlane, user: str, namespace: str) -> set[tuple[str, str]]:
    """(resource or URL, verb) of everything ``kubectl auth can-i --list`` grants ``user`` in ``namespace``."""
    listed = plane.kubectl("auth", "can-i", "--list", f"--as={user}", "--namespace", namespace).stdout
    granted = set()
    for line in listed.splitlines()[1:]:
        match = re.match(r"^(?:(\S+)\s+)?\[([^\]]*)\]\s+\[([^\]]*)\]\s+\[([^\]]*)\]$", line.strip())
        assert match, f"unexpected can-i line: {line!r}"
        resource, urls, names, verbs = match.groups()
        assert names == "", f"a grant narrowed to resource names: {line!r}"
        for verb in verbs.split():
            granted.add((resource or urls, verb))
    return granted


def _documented_grants() -> set[tuple[str, str]]:
    """The rows of docs/security-model.md's table that hold for the chart's defaults ("always")."""
    rows = re.findall(r"^\| `([^`]+)` \| ([a-z, ]+) \| ([a-z, -]+) \|", SECURITY_MODEL.read_text(), re.MULTILINE)
    assert rows, "docs/security-model.md has no permission table"
    return {(resource, verb.strip()) for resource, verbs, when in rows if when == "always" for verb in verbs.split(",")}


def test_the_service_account_may_do_only_what_the_security_model_lists(
    control_plane: ControlPlane, release: Release
) -> None:
    # What every signed-in identity may do (discovery, reviews of its own access) is the baseline.
    control_plane.kubectl("create", "serviceaccount", "nobody", "--namespace", release.namespace)
    baseline = _can_i(control_plane, f"system:serviceaccount:{release.namespace}:nobody", release.namespace)
    operator = _can_i(control_plane, f"system:serviceaccount:{release.namespace}:{OPERATOR}", release.namespace)
    assert operator - baseline == _documented_grants()


def _wait_for_condition(plane: ControlPlane, release: Release, status: str, text: str) -> dict[str, Any]:
    deadline = time.monotonic() + SYNCED_TIMEOUT_S
    synced: dict[str, Any] | None = None
    while time.monotonic() < deadline:
        synced = _condition(plane.get("batchprofile", PROFILE, namespace=release.namespace), "Synced")
        if synced and synced["status"] == status and text in synced.get("message", ""):
            return synced
        time.sleep(1)  # polling the API server for a condition
    raise AssertionError(f"Synced never became {status} with {text!r}: {synced}\n{release.operator.text()[-3000:]}")


def test_a_secret_is_sent_as_an_admin_token_only_if_it_opts_in(control_plane: ControlPlane, release: Release) -> None:
    ns = release.namespace
    token = base64.b64decode(control_plane.get("secret", TOKEN_SECRET, namespace=ns)["data"]["token"]).decode()
    # The same token in a Secret that does not carry the label: the runtime would accept it, but it is not sent.
    control_plane.kubectl("create", "secret", "generic", "unlabelled", f"--from-literal=token={token}", "-n", ns)

    def name_secret(name: str | None) -> None:
        secret = {"name": name, "key": "token"} if name else None
        patch = {"spec": {"runtime": {"adminTokenSecret": secret}}}
        control_plane.kubectl("patch", "batchprofile", PROFILE, "-n", ns, "--type=merge", "-p", json.dumps(patch))

    try:
        name_secret("unlabelled")
        _wait_for_condition(
            control_plane,
            release,
            "False",
            f'not sent: Secret {ns}/unlabelled lacks the label batchpilot.dev/admin-token: "true"',
        )
        # The chart's own token Secret carries the label.
        assert (
            control_plane.get("secret", TOKEN_SECRET, namespace=ns)["metadata"]["labels"]["batchpilot.dev/admin-token"]
            == "true"
        )
        name_secret(TOKEN_SECRET)
        _wait_for_condition(control_plane, release, "True", "")
    finally:
        name_secret(None)


EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "deploy" / "examples").glob("*.yaml"))


def test_every_example_is_applied_with_kubectl_and_taken_up_by_the_operator(
    control_plane: ControlPlane, release: Release
) -> None:
    """``kubectl apply -f`` (client-side, as the README has it) of every example, twice: the second changes
    nothing (what the server defaults does not read as a change). The release's operator (every namespace)
    reports each one: none is refused as invalid, each waits for pods."""
    namespace = control_plane.namespace("examples")
    manifests = []
    for path in EXAMPLES:
        manifest = yaml.safe_load(path.read_text())
        manifest["metadata"]["namespace"] = namespace  # the examples say "default": a namespace of this test's
        manifests.append(manifest)
    documents = yaml.safe_dump_all(manifests)
    names = [m["metadata"]["name"] for m in manifests]
    try:
        applied = control_plane.kubectl("apply", "-f", "-", stdin=documents).stdout
        assert applied.count(" created") == len(EXAMPLES), applied
        again = control_plane.kubectl("apply", "-f", "-", stdin=documents).stdout
        assert again.count(" unchanged") == len(EXAMPLES), again
        deadline = time.monotonic() + SYNCED_TIMEOUT_S
        reported: dict[str, dict[str, Any] | None] = {}
        while True:
            reported = {
                p["metadata"]["name"]: _condition(p, "Ready")
                for p in control_plane.get("batchprofiles", namespace=namespace)["items"]
            }
            if sorted(reported) == sorted(names) and all(reported.values()):
                break
            assert time.monotonic() < deadline, f"not every example reported: {reported}"
            time.sleep(1)  # polling the API server for the status the operator writes
        # No runtime pods here: valid examples wait for pods, none is refused as invalid.
        assert {name: ready["reason"] for name, ready in reported.items() if ready} == dict.fromkeys(
            names, "NoReadyPods"
        )
        listed = control_plane.kubectl("get", "bp", "-n", namespace).stdout
        assert "chat-assistant" in listed, listed
    finally:
        control_plane.kubectl("delete", "batchprofile", *names, "-n", namespace, "--ignore-not-found", "--wait=false")


def _hard_cap_in_runtime(release: Release) -> float | None:
    for line in httpx.get(f"http://{release.runtime.ip}:{SERVE_PORT}/metrics", timeout=10).text.splitlines():
        if line.startswith("batchpilot_window_hard_cap"):
            return float(line.split()[-1])
    return None


def _applied_windows(release: Release) -> tuple[list[int], int]:
    """The generations of the windows the runtime applied, in order (its "window updated" log lines), and how
    many ``PUT /admin/window`` it answered (refused ones too): its own record of every push it got."""
    generations, puts = [], 0
    for line in release.runtime.text().splitlines():
        if not line.startswith("{"):
            continue
        entry = json.loads(line)
        if entry.get("msg") == "window updated":
            generations.append(int(re.search(r"gen=(\d+)", entry["window"])[1]))  # type: ignore[index]
        elif (entry.get("method"), entry.get("path")) == ("PUT", "/admin/window"):
            puts += 1
    return generations, puts


def _registrations(release: Release) -> Counter[tuple[str, str, str]]:
    """How often the operator took in each (namespace, profile, generation): kopf's create, resume and update
    handlers. The release's operator watches every namespace, so the session's other tests' profiles (the
    examples, applied in several namespaces under the same names) count too."""
    found = re.findall(r"profile (\S+)/(\S+) \(generation (\d+)\) registered", release.operator.text())
    return Counter((namespace, name, generation) for namespace, name, generation in found)


def _observed_generation(plane: ControlPlane, namespace: str, name: str) -> int:
    status = plane.get("batchprofile", name, namespace=namespace).get("status") or {}
    return int(status.get("observedGeneration") or 0)


def _wait_for_observed(plane: ControlPlane, release: Release, names: list[str], generation: int) -> None:
    deadline = time.monotonic() + SYNCED_TIMEOUT_S
    while behind := [n for n in names if _observed_generation(plane, release.namespace, n) != generation]:
        assert time.monotonic() < deadline, (
            f"{behind} never observed generation {generation}\n" + (release.operator.text()[-3000:])
        )
        time.sleep(1)  # polling the API server for the status the operator writes


def _patch_window(plane: ControlPlane, namespace: str, name: str, window: dict[str, Any]) -> None:
    patch = json.dumps({"spec": {"window": window}})
    plane.kubectl("patch", "batchprofile", name, "-n", namespace, "--type=merge", "-p", patch)


def _wait_for_hard_cap(release: Release, hard_cap: float) -> None:
    deadline = time.monotonic() + SYNCED_TIMEOUT_S
    while _hard_cap_in_runtime(release) != hard_cap:
        assert time.monotonic() < deadline, (
            f"the runtime never got hardCap {hard_cap:g}\n" + (release.operator.text()[-3000:])
        )
        time.sleep(1)  # polling the runtime for the window in force


IDLE_PROFILES = ["idle-0", "idle-1", "idle-2"]  # beside the release's: no pod matches them


def test_the_operator_rides_out_a_kube_apiserver_restart(control_plane: ControlPlane, release: Release) -> None:
    """Same etcd, same port: the watches resume; no profile is lost (each one's change after the restart is
    observed) and none decided twice (each generation taken in once, each window pushed once)."""
    ns = release.namespace
    for name in IDLE_PROFILES:
        spec = make_spec_dict(name, tuning={"mode": "static"})
        control_plane.apply(make_manifest(spec, name=name, namespace=ns))
    try:
        _wait_for_observed(control_plane, release, IDLE_PROFILES, 1)
        before = _wait_for_synced(control_plane, release)["status"]["window"]
        profiles = {p["metadata"]["uid"] for p in control_plane.get("batchprofiles", namespace=ns)["items"]}
        control_plane.stop("kube-apiserver")
        control_plane.start("kube-apiserver")
        # While it starts the server answers the operator's reconnecting watches with 403 (its RBAC caches are
        # not filled yet) and 429 ("storage is (re)initializing"); kopf retries. The 403s can outlast /readyz by
        # a moment (seen once in CI: one 403 a second after the script saw /readyz), so the check below starts
        # once the operator has acted after the restart: from then on no request of its may be refused.
        # A change made after the restart reaches the operator only through a resumed watch (or the watch check).
        _patch_window(control_plane, ns, PROFILE, {"targetBatchSize": 6, "hardCap": 12, "maxWaitMs": 10})
        for name in IDLE_PROFILES:
            _patch_window(control_plane, ns, name, {"targetBatchSize": 4, "hardCap": 12, "maxWaitMs": 10})
        _wait_for_hard_cap(release, 12.0)
        acted_at = len(release.operator.text())
        after = _wait_for_synced(control_plane, release)["status"]["window"]
        # Decided once: one new generation for the one change, none for the restart itself.
        assert (after["hardCap"], after["generation"]) == (12, before["generation"] + 1), (before, after)
        # No profile lost: every one is still on the server, and the operator saw each one's change.
        assert {p["metadata"]["uid"] for p in control_plane.get("batchprofiles", namespace=ns)["items"]} == profiles
        _wait_for_observed(control_plane, release, IDLE_PROFILES, 2)
        assert release.operator.process.poll() is None
        # Liveness may fail for a while after /readyz: a custom resource's storage answers lists with 429
        # ("storage is (re)initializing") until its watch cache is filled again. It must come back.
        _wait_for_liveness(release, 200, timeout_s=60)
        # A second change, decided and pushed after the operator acted: nothing of it refused either.
        _patch_window(control_plane, ns, PROFILE, {"targetBatchSize": 6, "hardCap": 14, "maxWaitMs": 10})
        _wait_for_hard_cap(release, 14.0)
        assert release.operator.refused(since=acted_at) == []
        # Nothing taken in or pushed twice, through the whole run: each (profile, generation) registered once;
        # the runtime applied strictly newer generations, one push each, and none was refused.
        registrations = _registrations(release)
        assert [key for key, count in registrations.items() if count > 1] == [], registrations
        assert {(ns, name, "2") for name in IDLE_PROFILES} <= set(registrations)
        generations, puts = _applied_windows(release)
        assert generations == sorted(set(generations)) and puts == len(generations), (generations, puts)
        assert generations[-1] == _wait_for_synced(control_plane, release)["status"]["window"]["generation"]
    finally:
        control_plane.kubectl("delete", "batchprofile", *IDLE_PROFILES, "-n", ns, "--ignore-not-found", "--wait=false")


def _liveness(release: Release) -> tuple[int, str]:
    response = httpx.get(release.operator.liveness_url, timeout=10)
    return response.status_code, response.text


def _wait_for_liveness(release: Release, status: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while (probe := _liveness(release))[0] != status:
        assert time.monotonic() < deadline, f"liveness not {status} within {timeout_s:.0f} s: {probe}"
        time.sleep(1)  # polling the probe


def test_the_operator_reports_an_etcd_outage_and_recovers(control_plane: ControlPlane, release: Release) -> None:
    _wait_for_synced(control_plane, release)
    assert _liveness(release)[0] == 200
    control_plane.stop("etcd")
    try:
        # The watch check lists BatchProfiles every 3 s; two failures in a row fail liveness.
        # kopf answers a failed probe with a bare 500; the reason is in the operator's log.
        _wait_for_liveness(release, 500, timeout_s=90)
        assert "watch checks in a row; liveness fails" in release.operator.text()
    finally:
        control_plane.start("etcd")
    _wait_for_liveness(release, 200, timeout_s=90)
    assert release.operator.process.poll() is None
    assert "the API server answers again" in release.operator.text()
    _wait_for_synced(control_plane, release)
