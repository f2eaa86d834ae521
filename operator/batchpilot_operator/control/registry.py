"""Which profiles and pods exist, and which pods each profile selects.

The registry keeps the profile records, the pods by namespace, and two indexes: (namespace, label key,
label value) -> pods (model -> pods in local mode), so that finding a profile's pods costs its own pods, not
all pods (1,000 profiles x 4,000 pods otherwise); and the same key -> profiles, so that a pod turning Ready
finds the profiles that may select it without looking at all of them. It never reads or writes a window.
"""

from __future__ import annotations

from batchpilot_operator.control.records import PodRecord, ProfileRecord

IndexKey = tuple[str, str, str]


class Registry:
    def __init__(self, *, match_by_model: bool = False) -> None:
        self.match_by_model = match_by_model
        self.profiles: dict[str, ProfileRecord] = {}
        self.pods: dict[str, dict[str, PodRecord]] = {}  # namespace -> pod name -> pod
        self._pods_version = 0  # bumped on every pod change; keys each profile's cached pod list
        self._label_index: dict[IndexKey, dict[str, PodRecord]] = {}
        self._profile_index: dict[IndexKey, set[str]] = {}
        self._profiles_unindexed: set[str] = set()

    # ---- profiles -----------------------------------------------------------------------------------

    def index_key(self, record: ProfileRecord) -> IndexKey | None:
        """The profile's index key, from its first matchLabels pair; None for matchExpressions only."""
        spec = record.spec
        if spec is None:
            return None
        if self.match_by_model:
            return ("", "", spec.model)
        if spec.selector.match_labels:
            key, value = next(iter(spec.selector.match_labels.items()))
            return (record.ref.namespace, key, value)
        return None  # matchExpressions only: checked against every pod

    def put_profile(self, record: ProfileRecord, old_key: IndexKey | None) -> None:
        """Store the record and index it under its current spec (``old_key``: its key before the update)."""
        self.profiles[record.ref.key] = record
        if old_key is not None:
            self._profile_index.get(old_key, set()).discard(record.ref.key)
        self._profiles_unindexed.discard(record.ref.key)
        if record.spec is None:
            return
        new_key = self.index_key(record)
        if new_key is None:
            self._profiles_unindexed.add(record.ref.key)
        else:
            self._profile_index.setdefault(new_key, set()).add(record.ref.key)

    def pop_profile(self, key: str) -> ProfileRecord | None:
        record = self.profiles.pop(key, None)
        if record is not None:
            index_key = self.index_key(record)
            if index_key is not None:
                self._profile_index.get(index_key, set()).discard(record.ref.key)
            self._profiles_unindexed.discard(record.ref.key)
        return record

    # ---- pods ---------------------------------------------------------------------------------------

    def put_pod(self, pod: PodRecord) -> PodRecord | None:
        """Store the pod; returns what was stored under its name before, if anything."""
        before = self.pods.get(pod.namespace, {}).get(pod.name)
        if before is not None:
            self._unindex(before)
        self.pods.setdefault(pod.namespace, {})[pod.name] = pod
        self._index(pod)
        if before != pod:
            self._pods_version += 1
        return before

    def pop_pod(self, namespace: str, name: str) -> PodRecord | None:
        pod = self.pods.get(namespace, {}).pop(name, None)
        if pod is not None:
            self._unindex(pod)
            self._pods_version += 1
        return pod

    def profiles_selecting(self, pod: PodRecord) -> list[ProfileRecord]:
        """The valid profiles that select this pod, found through the profile index (not every profile)."""
        keys = set(self._profiles_unindexed)
        for index_key in self._index_keys(pod):
            keys |= self._profile_index.get(index_key, set())
        candidates = [self.profiles[k] for k in sorted(keys) if k in self.profiles]
        return [r for r in candidates if r.spec is not None and self.selects(r, pod)]

    def selects(self, record: ProfileRecord, pod: PodRecord) -> bool:
        if record.spec is None:
            return False
        if self.match_by_model:
            return pod.model == record.spec.model
        return pod.namespace == record.ref.namespace and record.spec.selector.matches(dict(pod.labels))

    def pods_of(self, record: ProfileRecord) -> list[PodRecord]:
        """The profile's pods, sorted; cached until a pod or the profile's selector changes."""
        spec = record.spec
        if spec is None:
            return []
        cache_key = (self._pods_version, id(spec))
        if record.pods_cache.key == cache_key:
            return record.pods_cache.pods
        index_key = self.index_key(record)
        candidates: list[PodRecord]
        if index_key is not None:
            candidates = list(self._label_index.get(index_key, {}).values())
        else:
            candidates = list(self.pods.get(record.ref.namespace, {}).values())
        record.pods_cache.pods = sorted((p for p in candidates if self.selects(record, p)), key=lambda p: p.key)
        record.pods_cache.key = cache_key
        return record.pods_cache.pods

    def _index_keys(self, pod: PodRecord) -> list[IndexKey]:
        if self.match_by_model:
            return [("", "", pod.model or "")]
        return [(pod.namespace, key, value) for key, value in pod.labels.items()]

    def _index(self, pod: PodRecord) -> None:
        for key in self._index_keys(pod):
            self._label_index.setdefault(key, {})[pod.key] = pod

    def _unindex(self, pod: PodRecord) -> None:
        for key in self._index_keys(pod):
            self._label_index.get(key, {}).pop(pod.key, None)
