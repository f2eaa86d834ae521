"""The SGLang apply path: a window's cap and prefill budget to SGLang pods, live where the server takes them.

An SGLang pod has no window, only the two settings that carry one
(:func:`~batchpilot_operator.control.engine_knobs.sglang_server_args`). Each sync reads what the
server holds and sends what differs (:class:`~batchpilot_operator.io.sglang.SGLangClient`); a pod
holding both is synced to the window's generation (``PodSync.applied``). A setting the server does not
take live is the pod's failure, ``refused``, naming it and the value the server keeps: it takes effect
only by a restart with new flags, and the operator never restarts an SGLang pod, so the Synced
condition says so until the server takes it (e.g. after SGLang #37661) or the window no longer needs it.
What each server showed it takes is kept per pod and uid, so a restarted pod is asked again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from batchpilot_operator.control.conditions import PodFailure
from batchpilot_operator.control.engine_knobs import sglang_server_args
from batchpilot_operator.control.records import PodRecord, ProfileRecord
from batchpilot_operator.io.outbound import base_url
from batchpilot_operator.io.outcomes import ERROR, REFUSED
from batchpilot_operator.io.sglang import LiveKeys, SGLangApplied, SGLangClient, SGLangError
from batchpilot_runtime.contract.window import Window


class SGLangSync:
    def __init__(self, client: SGLangClient) -> None:
        self.client = client
        self._known: dict[tuple[str, str | None], LiveKeys] = {}  # (pod key, pod uid) -> what it showed

    def url(self, record: ProfileRecord, pod: PodRecord) -> str | None:
        """The pod's serving URL, where SGLang has its live settings (local mode gives it as admin=)."""
        if pod.admin_url:
            return pod.admin_url
        if pod.ip and record.spec is not None:
            return base_url(pod.ip, record.spec.runtime.serve_port)
        return None

    async def sync(self, record: ProfileRecord, pods: Sequence[PodRecord], window: Window) -> None:
        """Bring every Ready pod in ``pods`` to ``window``'s settings; each outcome lands on ``record.sync``."""
        settings = sglang_server_args(window)
        targets = [(pod, url) for pod in pods if pod.ready and (url := self.url(record, pod)) is not None]
        outcomes = await asyncio.gather(
            *(self.client.apply(url, settings, self._known.setdefault((pod.key, pod.uid), LiveKeys()))
              for pod, url in targets),
            return_exceptions=True,
        )  # fmt: skip
        for (pod, url), outcome in zip(targets, outcomes, strict=True):
            self._record(record, pod.key, url, window, outcome)

    @staticmethod
    def _record(
        record: ProfileRecord, pod: str, url: str, window: Window, outcome: SGLangApplied | BaseException
    ) -> None:
        sync = record.sync
        if isinstance(outcome, SGLangError):
            sync.pod_errors[pod] = PodFailure(ERROR, str(outcome))
        elif isinstance(outcome, BaseException):
            raise outcome
        elif not outcome.complete:
            sync.pod_errors[pod] = PodFailure(
                REFUSED,
                f"SGLang at {url} does not take {outcome.describe_not_live()} live through /set_internal_state; "
                "it takes effect only by restarting the pod with these flags, which the operator does not do",
            )
        else:
            sync.pod_errors.pop(pod, None)
            sync.applied[pod] = window.generation
