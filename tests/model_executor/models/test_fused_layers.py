"""fused_layers.plan_runs / FusedLayerRun: which decoder layers share one fd_decoder_layers call."""

import pytest

from fastdeploy import _custom_ops
from fastdeploy.model_executor.models.fused_layers import FusedLayerRun, plan_runs
from tests.model_executor.utils import build_tiny_checkpoint, load_our_model

pytestmark = pytest.mark.skipif(not _custom_ops.has("fd_decoder_layers"), reason="the C++ kernels are not built")


@pytest.fixture(scope="module")
def args(tmp_path_factory):
    """The fused kernel's arguments of each layer of a tiny 3-layer Llama."""
    folder = build_tiny_checkpoint("LlamaForCausalLM", tmp_path_factory.mktemp("llama"), num_hidden_layers=3)
    return [layer._fused_args for layer in load_our_model(folder).model.layers]


def _other_settings(a):
    """The same layer with another intermediate size: a different signature."""
    return a._replace(settings=(a.settings[0], a.settings[1] + 64, *a.settings[2:]))


def _spans(plan):
    return [(start, stop, run is not None) for start, stop, run in plan]


def test_runs_are_maximal_and_break_at_unfused_layers_and_new_signatures(args):
    a, b, c = args
    assert _spans(plan_runs([a, b, c])) == [(0, 3, True)]
    assert _spans(plan_runs([a, None, b, c])) == [(0, 1, True), (1, 2, False), (2, 4, True)]
    assert _spans(plan_runs([a, b, _other_settings(c), None])) == [(0, 2, True), (2, 3, True), (3, 4, False)]
    assert _spans(plan_runs([None, None])) == [(0, 1, False), (1, 2, False)]
    assert _spans(plan_runs([a, b, c], max_layers=2)) == [(0, 2, True), (2, 3, True)]
    assert _spans(plan_runs([a, b, c], max_layers=1)) == [(0, 1, True), (1, 2, True), (2, 3, True)]


def test_a_run_holds_one_tensor_per_layer_and_the_segments_of_each(args):
    run = plan_runs(args)[0][2]
    assert (run.start, run.stop) == (0, 3)
    input_norms, qkv_weights = run._before[0], run._before[1]
    assert [id(t) for t in input_norms] == [id(a.input_norm) for a in args]
    assert [id(t) for t in qkv_weights] == [id(a.qkv.weight) for a in args]
    assert run._before[2] is None  # Llama has no qkv bias: the optional list is left out whole
    # Packed (not GGUF) weights have no segment values: a count of 0 for each of the 3 x 4 matmuls.
    assert run._after[-3] == [0] * 12


def test_layers_of_different_signatures_are_refused_in_one_run(args):
    with pytest.raises(ValueError, match="same signature"):
        FusedLayerRun(0, [args[0], _other_settings(args[1])])
    with pytest.raises(ValueError, match="same signature"):
        FusedLayerRun(0, [])
