"""The SGLang apply path against a stand-in that follows /set_internal_state's contract from SGLang's source
(tests/support/sglang_standin.py): keys found live by asking the server, the rest reported for a restart."""

from __future__ import annotations

import pytest

from batchpilot_operator.io.sglang import LiveKeys, SGLangClient, SGLangError
from tests.support.sglang_standin import PROPOSED_KEYS, SGLangStandIn, sglang_standin

SETTINGS = {"max_running_requests": 64, "chunked_prefill_size": 2048}


async def test_a_server_that_takes_the_cap_and_budget_live_holds_them_on_every_scheduler() -> None:
    standin = SGLangStandIn(allow=PROPOSED_KEYS, schedulers=2)
    client = SGLangClient()
    known = LiveKeys()
    with sglang_standin(standin) as url:
        result = await client.apply(url, SETTINGS, known)
        again = await client.apply(url, SETTINGS, known)
    await client.aclose()
    assert result.complete and result.applied == SETTINGS
    assert known.live == set(SETTINGS) and known.refused == {}
    # Each key alone: one unknown key would void the whole request.
    assert standin.posts == [{"max_running_requests": 64}, {"chunked_prefill_size": 2048}]
    assert again.applied == SETTINGS and len(standin.posts) == 2  # held already: nothing sent


async def test_todays_sglang_answers_updated_for_keys_it_ignores_and_the_read_back_tells() -> None:
    standin = SGLangStandIn()  # SGLang's allow-list today: neither key
    client = SGLangClient()
    known = LiveKeys()
    with sglang_standin(standin) as url:
        result = await client.apply(url, SETTINGS, known)
        second = await client.apply(url, {"max_running_requests": 32, "chunked_prefill_size": 2048}, known)
    await client.aclose()
    assert result.applied == {} and result.not_live == SETTINGS
    assert result.held == {"max_running_requests": 128, "chunked_prefill_size": 8192}
    assert "max_running_requests=64 (server holds 128)" in result.describe_not_live()
    assert standin.warnings == ["Updating max_running_requests is not supported.",
                                "Updating chunked_prefill_size is not supported."]  # fmt: skip
    # Found once: a key the server refused is not sent to it again, whatever its value.
    assert len(standin.posts) == 2
    assert second.not_live == {"max_running_requests": 32, "chunked_prefill_size": 2048}


async def test_a_server_taking_one_key_gets_it_and_reports_the_other() -> None:
    standin = SGLangStandIn(allow=PROPOSED_KEYS - {"chunked_prefill_size"})
    client = SGLangClient()
    with sglang_standin(standin) as url:
        result = await client.apply(url, SETTINGS, LiveKeys())
    await client.aclose()
    assert result.applied == {"max_running_requests": 64}
    assert result.not_live == {"chunked_prefill_size": 2048}
    assert standin.server_args["max_running_requests"] == 64


async def test_a_restarted_server_is_asked_again_for_a_key_it_took_before() -> None:
    standin = SGLangStandIn(allow=PROPOSED_KEYS)
    client = SGLangClient()
    known = LiveKeys()
    with sglang_standin(standin) as url:
        await client.apply(url, SETTINGS, known)
        standin.server_args["max_running_requests"] = 128  # restarted with its flags
        result = await client.apply(url, SETTINGS, known)
    await client.aclose()
    assert result.applied == SETTINGS
    assert standin.posts[-1] == {"max_running_requests": 64}


async def test_a_server_without_the_endpoint_takes_nothing_live() -> None:
    standin = SGLangStandIn(endpoint=False)
    client = SGLangClient()
    with sglang_standin(standin) as url, pytest.raises(SGLangError, match="HTTP 404, not SGLang's server info"):
        await client.apply(url, SETTINGS, LiveKeys())
    await client.aclose()


async def test_an_unreachable_server_is_an_error_naming_the_url() -> None:
    client = SGLangClient(timeout_s=1.0)
    with pytest.raises(SGLangError, match=r"GET http://127\.0\.0\.1:9/get_server_info"):
        await client.apply("http://127.0.0.1:9", SETTINGS, LiveKeys())
    await client.aclose()


async def test_a_release_without_set_internal_state_takes_nothing_live_and_is_asked_once() -> None:
    standin = SGLangStandIn(allow=PROPOSED_KEYS, set_endpoint=False)
    client = SGLangClient()
    known = LiveKeys()
    with sglang_standin(standin) as url:
        first = await client.apply(url, SETTINGS, known)
        second = await client.apply(url, SETTINGS, known)
    await client.aclose()
    assert first.not_live == second.not_live == SETTINGS
    assert set(known.refused) == set(SETTINGS)
    assert client.requests_total == 2 + 1 + 1  # info, one 404 POST, info; then info alone
