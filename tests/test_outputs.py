"""RequestOutput / CompletionOutput / Logprob match vLLM's shapes, plus the legacy ``outputs.text``."""

import copy
import pickle

import pytest

from fastdeploy.logprobs import (
    Logprob,
    append_logprobs_for_next_position,
    create_prompt_logprobs,
    create_sample_logprobs,
)
from fastdeploy.outputs import (
    BeamSearchOutput,
    BeamSearchSequence,
    CompletionOutput,
    CompletionOutputList,
    RequestMetrics,
    RequestOutput,
    get_beam_search_score,
)


def _completion(index=0, text="hi", token_ids=None, finish_reason=None, **kw):
    return CompletionOutput(
        index=index,
        text=text,
        token_ids=[1, 2] if token_ids is None else token_ids,
        cumulative_logprob=-0.5,
        logprobs=None,
        finish_reason=finish_reason,
        **kw,
    )


def _request(outputs, **kw):
    args = {
        "request_id": "r1",
        "prompt": "Hello",
        "prompt_token_ids": [10, 11],
        "prompt_logprobs": None,
        "outputs": outputs,
        "finished": True,
    }
    args.update(kw)
    return RequestOutput(**args)


# ---------------------------------------------------------------- logprobs


def test_logprob_fields():
    lp = Logprob(-0.1)
    assert lp.logprob == -0.1 and lp.rank is None and lp.decoded_token is None
    assert Logprob(logprob=-1.0, rank=2, decoded_token="a") == Logprob(-1.0, 2, "a")


def test_logprob_helpers():
    prompt = create_prompt_logprobs()
    assert prompt == [None]
    sample = create_sample_logprobs()
    append_logprobs_for_next_position(sample, [5, 7, 5], [-1.0, -0.5, -1.0], ["a", "b", "a"], rank=2, num_logprobs=2)
    assert sample == [{5: Logprob(-1.0, 2, "a"), 7: Logprob(-0.5, 1, "b")}]
    assert list(sample[0]) == [5, 7]
    append_logprobs_for_next_position(sample, [3, 3, 4], [-0.1, -0.1, -2.0], None, rank=1, num_logprobs=-1)
    assert sample[1] == {3: Logprob(-0.1, 1, None), 4: Logprob(-2.0, 2, None)}


# ---------------------------------------------------------------- CompletionOutput


def test_completion_output_finished():
    assert not _completion().finished()
    assert _completion(finish_reason="stop").finished()
    c = _completion(finish_reason="stop", stop_reason="###")
    assert c.stop_reason == "###"


def test_completion_output_repr():
    text = repr(_completion(text="a'b"))
    assert text.startswith('CompletionOutput(index=0, text="a\'b", token_ids=[1, 2], cumulative_logprob=-0.5')
    assert "finish_reason=None" in text


# ---------------------------------------------------------------- RequestOutput


def test_request_output_fields():
    metrics = RequestMetrics(arrival_time=1.0)
    ro = _request([_completion()], metrics=metrics, num_cached_tokens=3)
    assert ro.request_id == "r1"
    assert ro.prompt == "Hello"
    assert ro.prompt_token_ids == [10, 11]
    assert ro.prompt_logprobs is None
    assert ro.finished is True
    assert ro.metrics is metrics
    assert ro.num_cached_tokens == 3
    assert ro.kv_transfer_params is None


def test_outputs_is_list_and_indexable():
    c0, c1 = _completion(0, "first"), _completion(1, "second")
    ro = _request([c0, c1])
    assert isinstance(ro.outputs, list)
    assert isinstance(ro.outputs, CompletionOutputList)
    assert len(ro.outputs) == 2
    assert ro.outputs[0].text == "first"
    assert ro.outputs[1].text == "second"
    assert [o.index for o in ro.outputs] == [0, 1]
    assert ro.outputs == [c0, c1]


def test_legacy_outputs_attribute_access():
    ro = _request(
        [
            _completion(0, "first", token_ids=[4, 5], finish_reason="length"),
            _completion(1, "second"),
        ]
    )
    # FastDeploy's former single-output form reads the first completion.
    assert ro.outputs.text == "first"
    assert ro.outputs.token_ids == [4, 5]
    assert ro.outputs.finish_reason == "length"
    assert ro.outputs.cumulative_logprob == -0.5
    assert ro.outputs.finished() is True
    # Writes reach the first completion too.
    ro.outputs.text = "changed"
    assert ro.outputs[0].text == "changed"
    # List methods stay list methods.
    assert ro.outputs.index(ro.outputs[1]) == 1
    with pytest.raises(AttributeError):
        ro.outputs.no_such_field  # noqa: B018
    with pytest.raises(AttributeError):
        ro.outputs.append = None


def test_legacy_access_on_empty_outputs():
    ro = _request([])
    assert ro.outputs == []
    with pytest.raises(AttributeError):
        ro.outputs.text  # noqa: B018


def test_outputs_reassignment_rewraps():
    ro = _request([])
    ro.outputs = [_completion(0, "x")]
    assert isinstance(ro.outputs, CompletionOutputList)
    assert ro.outputs.text == "x"


def test_outputs_from_generator():
    ro = _request(_completion(i, str(i)) for i in range(3))
    assert [o.text for o in ro.outputs] == ["0", "1", "2"]


def test_request_output_pickle_and_copy():
    ro = _request(
        [_completion(0, "a"), _completion(1, "b")],
        metrics=RequestMetrics(arrival_time=2.0),
    )
    for other in (pickle.loads(pickle.dumps(ro)), copy.deepcopy(ro), copy.copy(ro)):
        assert isinstance(other.outputs, CompletionOutputList)
        assert other.outputs.text == "a"
        assert other.outputs[1].text == "b"
        assert other.metrics.arrival_time == 2.0
    lst = CompletionOutputList([_completion(0, "z")])
    assert pickle.loads(pickle.dumps(lst)).text == "z"


def test_request_output_repr():
    text = repr(_request([_completion()]))
    assert text.startswith("RequestOutput(request_id=r1, prompt='Hello', prompt_token_ids=[10, 11]")
    assert "outputs=[CompletionOutput(index=0, text='hi'" in text
    assert "finished=True" in text


def test_extra_kwargs_ignored():
    ro = _request([_completion()], future_field=1)
    assert not hasattr(ro, "future_field")


def test_kv_transfer_params():
    assert _request([_completion()], kv_transfer_params={"a": 1}).kv_transfer_params == {"a": 1}
    one = _request([_completion(kv_transfer_params={"x": 1})])
    assert one.kv_transfer_params == {"x": 1}
    two = _request(
        [
            _completion(0, kv_transfer_params={"x": 1}),
            _completion(1, kv_transfer_params={"x": 2}),
        ]
    )
    assert two.kv_transfer_params == [{"x": 1}, {"x": 2}]


def test_add_aggregate_and_replace():
    lp1, lp2 = {1: Logprob(-0.1)}, {2: Logprob(-0.2)}
    base = _request([CompletionOutput(0, "Hel", [1], -0.1, [lp1])], finished=False)
    delta = _request(
        [CompletionOutput(0, "lo", [2], -0.3, [lp2], finish_reason="stop", stop_reason=None)],
        finished=True,
    )
    base.add(delta, aggregate=True)
    assert base.finished
    assert base.outputs.text == "Hello"
    assert base.outputs.token_ids == [1, 2]
    assert base.outputs.logprobs == [lp1, lp2]
    assert base.outputs.cumulative_logprob == -0.3
    assert base.outputs.finish_reason == "stop"

    base = _request([_completion(0, "old")], finished=False)
    new = _completion(0, "new")
    base.add(_request([new, _completion(1, "extra")], finished=False), aggregate=False)
    assert base.outputs[0] is new
    assert base.outputs[1].text == "extra"
    assert not base.finished


# ---------------------------------------------------------------- metrics


def test_request_metrics():
    m = RequestMetrics(arrival_time=10.0)
    m.record_scheduled(now=10.5)
    m.record_scheduled(now=11.0)  # only the first scheduling counts
    assert m.first_scheduled_time == 10.5 and m.time_in_queue == 0.5
    m.record_tokens(1, now=11.0)
    m.record_tokens(2, now=12.0)
    m.record_finished(now=12.5)
    assert m.first_token_time == 11.0 and m.last_token_time == 12.0
    assert m.num_generation_tokens == 3
    assert m.first_token_latency == 1.0
    assert m.e2e_latency == 2.5
    assert m.time_per_output_token == 0.5
    assert RequestMetrics().time_per_output_token is None


# ---------------------------------------------------------------- beam search


def test_beam_search_types():
    seq = BeamSearchSequence(tokens=[1, 2, 3], cum_logprob=-1.5)
    assert seq.logprobs == [] and seq.text is None and seq.finish_reason is None
    out = BeamSearchOutput(sequences=[seq])
    assert out.sequences[0].tokens == [1, 2, 3]


def test_beam_search_score():
    assert get_beam_search_score([1, 2, 3, 4], -2.0, eos_token_id=None) == -0.5
    # A trailing EOS does not count towards the length.
    assert get_beam_search_score([1, 2, 3, 4, 9], -2.0, eos_token_id=9) == -0.5
    assert get_beam_search_score([1, 2, 3, 4], -2.0, eos_token_id=None, length_penalty=0.0) == -2.0
