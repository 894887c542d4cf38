"""--speculative-config: vLLM's keys and older spellings, FastDeploy's aliases, clear errors."""

import pytest

from fastdeploy.engine.arg_utils import EngineArgs
from fastdeploy.spec_decode.config import SpeculativeConfig
from fastdeploy.utils.argparse_utils import FlexibleArgumentParser


def test_vllm_keys_and_defaults():
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3})
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == ("ngram", 4, 3, 3)
    # vLLM's default window when neither bound is given.
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (5, 5)
    assert SpeculativeConfig.from_dict(None) is None


@pytest.mark.parametrize("raw, method", [
    ({"model": "ngram", "num_speculative_tokens": 3}, "ngram"),
    ({"model": "[ngram]", "num_speculative_tokens": 3}, "ngram"),
    ({"method": "[ngram]", "num_speculative_tokens": 3}, "ngram"),
    ({"speculative_model": "[ngram]", "num_speculative_tokens": 3, "ngram_prompt_lookup_max": 4}, "ngram"),
    ({"method": "ngram", "num_model_steps": 3, "max_ngram_size": 4, "min_ngram_size": 2}, "ngram"),
    ({"model": "/some/draft", "num_speculative_tokens": 3}, "draft_model"),
    ({"method": "suffix", "num_speculative_tokens": 3}, "suffix"),
    ({"method": "deepseek_mtp", "num_speculative_tokens": 3}, "mtp"),
    ({"method": "mtp", "num_model_steps": 3}, "mtp"),
])
def test_spellings(raw, method):
    c = SpeculativeConfig.from_dict(raw)
    assert c.method == method and c.num_speculative_tokens == 3


def test_fastdeploy_aliases_map_to_vllm_keys():
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_model_steps": 2, "max_ngram_size": 4,
                                     "min_ngram_size": 2, "verify_strategy": "target_match"})
    assert (c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == (2, 2, 4)


@pytest.mark.parametrize("raw, message", [
    ({"method": "ngram", "num_speculative_tokens": 3, "bogus": 1}, "'bogus'"),
    ({"method": "eagle7", "num_speculative_tokens": 3}, "'eagle7'"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "'model'"),
    ({"method": "mtp", "num_speculative_tokens": 1, "model": "/elsewhere"}, "'model'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "verify_strategy": "topp"}, "verify_strategy"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0}, "disable_by_batch_size"),
    ({"method": "ngram", "num_model_steps": 2, "num_speculative_tokens": 3}, "num_speculative_tokens"),
])
def test_bad_configs_name_the_key(raw, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.from_dict(raw)


def test_cli_json_and_dotted_keys():
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    args = EngineArgs.from_cli_args(parser.parse_args(
        ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}']))
    assert SpeculativeConfig.from_dict(args.speculative_config).num_speculative_tokens == 3
    args = EngineArgs.from_cli_args(parser.parse_args(
        ["--speculative-config.method", "suffix", "--speculative-config.num_speculative_tokens", "2"]))
    assert SpeculativeConfig.from_dict(args.speculative_config).method == "suffix"
