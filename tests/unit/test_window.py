import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from batchpilot_runtime.contract.admin_api import WindowUpdate
from batchpilot_runtime.contract.window import MAX_GENERATION, Window
from tests.support.factories import make_window, make_window_dict


def test_camel_case_on_the_wire_snake_case_in_python() -> None:
    window = make_window(generation=3)
    assert window.target_batch_size == 8
    assert window.model_dump(by_alias=True) == {
        "targetBatchSize": 8,
        "hardCap": 16,
        "maxWaitMs": 20,
        "tailMarkRatio": 2.0,
        "generation": 3,
    }


def test_the_prefill_budget_travels_when_set_and_is_left_out_when_unset() -> None:
    budgeted = make_window(prefill=512, generation=1)
    wire = budgeted.model_dump(by_alias=True, mode="json")
    assert wire["maxPrefillTokens"] == 512
    assert Window.model_validate(wire) == budgeted
    assert "maxPrefillTokens" not in make_window().model_dump(by_alias=True, mode="json")
    assert "max_prefill_tokens" not in make_window().model_dump()
    assert not budgeted.fields_equal(make_window(generation=1))
    assert budgeted.describe() == "target=8 cap=16 wait=20ms tail=2x budget=512 gen=1"
    assert make_window().describe() == "target=8 cap=16 wait=20ms tail=2x gen=0"


def test_target_above_cap_is_refused_naming_both_fields() -> None:
    with pytest.raises(ValidationError) as caught:
        make_window(target=16, cap=8)
    message = str(caught.value)
    assert "targetBatchSize (16)" in message
    assert "hardCap (8)" in message


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("targetBatchSize", 0),
        ("hardCap", 0),
        ("maxWaitMs", -1),
        ("tailMarkRatio", 1.0),
        ("tailMarkRatio", 0.5),
        ("generation", -1),
        ("generation", MAX_GENERATION + 1),
        ("maxPrefillTokens", 0),
        ("targetBatchSize", "many"),
    ],
)
def test_each_bad_field_is_named(field: str, value: object) -> None:
    with pytest.raises(ValidationError) as caught:
        Window.model_validate({**make_window_dict(), field: value})
    assert [e["loc"] for e in caught.value.errors()] == [(field,)]


def test_the_largest_generation_is_exact_in_a_double() -> None:
    # The runtime exports the generation as a float gauge: every one it accepts must survive that.
    window = Window.model_validate({**make_window_dict(), "generation": MAX_GENERATION})
    assert int(float(window.generation)) == window.generation == MAX_GENERATION
    assert float(MAX_GENERATION + 1) == float(MAX_GENERATION + 2)  # past it, two generations share one value


def test_unknown_fields_are_refused() -> None:
    with pytest.raises(ValidationError) as caught:
        Window.model_validate({**make_window_dict(), "batchSize": 4})
    assert caught.value.errors()[0]["loc"] == ("batchSize",)


def test_update_body_round_trips() -> None:
    body = {"window": make_window(generation=7).model_dump(by_alias=True)}
    update = WindowUpdate.model_validate(body)
    assert update.window.generation == 7
    assert update.lanes is None


@given(
    target=st.integers(min_value=1, max_value=4096),
    cap=st.integers(min_value=1, max_value=4096),
    wait=st.integers(min_value=0, max_value=60_000),
)
def test_valid_exactly_when_target_within_cap(target: int, cap: int, wait: int) -> None:
    try:
        window = make_window(target=target, cap=cap, wait_ms=wait)
    except ValidationError:
        assert target > cap
    else:
        assert window.target_batch_size <= window.hard_cap


def test_fields_equal_ignores_generation() -> None:
    assert make_window(generation=1).fields_equal(make_window(generation=9))
    assert not make_window().fields_equal(make_window(wait_ms=21))
