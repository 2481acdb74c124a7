"""Tests for pipespec/config.py: `load_config` parses dicts and YAML files into frozen dataclasses,
and rejects every invalid config with a `ConfigError` whose message names the key and the value."""

import dataclasses

import pytest

from pipespec.config import (
    ConfigError,
    FaultSpec,
    LimitsSpec,
    MockOptions,
    ModelOptions,
    NgramOptions,
    PipelineConfig,
    SamplingSpec,
    ServerSpec,
    StageSpec,
    load_config,
    sub_pipeline,
    with_stages,
)
from pipespec.protocol.params import VerifyMode
from pipespec.protocol.tree_shape import TreeShape
from pipespec.schema.kinds import DreamOptions


def mock_config(**overrides):
    """A valid two-stage mock pipeline; `overrides` replace top-level keys."""
    config = {
        "name": "toy",
        "stages": [
            {"name": "drafter", "kind": "mock", "agreement": 0.7, "vocab_size": 64},
            {"name": "target", "kind": "mock", "vocab_size": 64},
        ],
    }
    config.update(overrides)
    return config


def with_stage(index, **changes):
    """The mock config with keys of stage `index` changed."""
    config = mock_config()
    config["stages"][index].update(changes)
    return config


# --- valid configs ------------------------------------------------------------------------------


def test_valid_mock_config_parses_with_defaults():
    config = load_config(mock_config())

    assert isinstance(config, PipelineConfig)
    assert config.name == "toy"
    assert [s.name for s in config.stages] == ["drafter", "target"]
    assert config.target is config.stages[-1]

    drafter = config.stages[0]
    assert isinstance(drafter, StageSpec)
    assert drafter.kind == "mock"
    assert drafter.model is None
    assert drafter.max_lookahead == 8
    assert drafter.dtype == "bfloat16"
    assert drafter.device == "cpu"
    assert drafter.resources == {"num_cpus": 1}
    assert drafter.options == MockOptions(agreement=0.7, vocab_size=64)
    assert config.target.options == MockOptions(vocab_size=64)

    assert config.sampling == SamplingSpec()
    assert config.sampling.verify is VerifyMode.COUPLED
    assert config.server == ServerSpec()


def test_config_dataclasses_are_frozen():
    config = load_config(mock_config())
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.name = "other"
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.stages[0].max_lookahead = 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.stages[0].options.agreement = 0.1
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.sampling.temperature = 1.0


def test_sampling_and_server_sections_parse():
    config = load_config(
        mock_config(
            sampling={"temperature": 1, "top_p": 0.9, "top_k": 5, "seed": 7, "verify": "rejection"},
            server={"host": "0.0.0.0", "port": 8000},
        )
    )
    assert config.sampling == SamplingSpec(temperature=1.0, top_p=0.9, top_k=5, seed=7, verify=VerifyMode.REJECTION)
    assert isinstance(config.sampling.temperature, float)  # an int is accepted for a float
    assert config.server == ServerSpec("0.0.0.0", 8000)
    params = config.sampling.params(seed=11, top_k=None)  # None overrides are ignored
    assert (params.seed, params.top_k, params.rejection) == (11, 5, True)


def test_ngram_first_then_model_stage(tmp_path):
    config = load_config(
        {
            "stages": [
                {"name": "lookup", "kind": "ngram", "max_n": 3},
                {"name": "target", "kind": "causal_lm", "model": str(tmp_path), "dtype": "float32"},
            ]
        }
    )
    assert config.name == "pipeline"
    assert config.stages[0].options == NgramOptions(min_n=1, max_n=3)
    assert config.target.model == str(tmp_path)
    assert config.target.options == ModelOptions()  # compiled (by default), the device's widths
    assert config.target.dtype == "float32"


def test_model_options(tmp_path):
    stage = {"name": "target", "kind": "vlm", "model": str(tmp_path), "compile": False, "max_context": 1024, "min_width": 2}
    assert load_config({"stages": [stage]}).target.options == ModelOptions(compile=False, max_context=1024, min_width=2)
    for key, value, message in (
        ("compile", "yes", "stages[0].compile: expected bool or NoneType, got 'yes'"),
        ("max_width", 6, "stages[0].max_width: must be a power of two >= 1, got 6"),
        ("min_width", 16, "stages[0].min_width: must be a power of two from 1 to max_width (8), got 16"),
        ("max_context", 1, "stages[0].max_context: must be >= 2, got 1"),
    ):
        with pytest.raises(ConfigError) as e:
            load_config({"stages": [{**stage, key: value}]})
        assert str(e.value) == message


def test_dream_options(tmp_path):
    dream = {"name": "dream", "kind": "dream", "model": str(tmp_path), "refresh": True, "max_width": 4}
    target = {"name": "target", "kind": "vlm", "model": str(tmp_path)}
    assert load_config({"stages": [dream, target]}).stages[0].options == DreamOptions(refresh=True, max_width=4)
    with pytest.raises(ConfigError) as e:
        load_config({"stages": [{**dream, "refresh": 1}, target]})
    assert str(e.value) == "stages[0].refresh: expected bool, got 1"


def test_yaml_file_parses(tmp_path):
    path = tmp_path / "pipeline.yaml"
    path.write_text(
        "name: from-yaml\n"
        "stages:\n"
        "  - {name: a, kind: mock, agreement: 0.5}\n"
        "  - {name: b, kind: mock, max_lookahead: 0}\n"
        "sampling: {temperature: 0.7}\n"
    )
    config = load_config(path)
    assert config.name == "from-yaml"
    assert config.stages[0].options.agreement == 0.5
    assert config.stages[1].max_lookahead == 0
    assert config.sampling.temperature == 0.7
    assert load_config(str(path)) == config


# --- invalid configs ----------------------------------------------------------------------------


def test_unknown_top_level_key():
    with pytest.raises(ConfigError, match=r"config: unknown key 'stage' \(did you mean 'stages'\?\)"):
        load_config({"stage": [], **mock_config()})


def test_unknown_stage_key_has_did_you_mean_hint():
    with pytest.raises(ConfigError, match=r"stages\[0\].*unknown key 'max_lookahed' \(did you mean 'max_lookahead'\?\)"):
        load_config(with_stage(0, max_lookahed=4))


def test_unknown_kind_names_value_and_suggests():
    with pytest.raises(ConfigError, match=r"stages\[1\]\.kind: unknown kind 'causal-lm' \(did you mean 'causal_lm'\?\)"):
        load_config(with_stage(1, kind="causal-lm"))


def test_missing_model_directory_is_named(tmp_path):
    missing = tmp_path / "no-such-model"
    config = {"stages": [{"name": "target", "kind": "causal_lm", "model": str(missing)}]}
    with pytest.raises(ConfigError, match=r"stages\[0\]\.model: model directory .*no-such-model.* does not exist"):
        load_config(config)


def test_model_kind_without_model():
    with pytest.raises(ConfigError, match=r"stages\[0\]\.model: kind 'causal_lm' needs a model directory"):
        load_config({"stages": [{"name": "target", "kind": "causal_lm"}]})


def test_model_given_to_mock_stage(tmp_path):
    with pytest.raises(ConfigError, match=r"stages\[0\]\.model: kind 'mock' takes no model"):
        load_config(with_stage(0, model=str(tmp_path)))


def test_negative_max_lookahead():
    with pytest.raises(ConfigError, match=r"stages\[0\]\.max_lookahead: must be >= 0, got -1"):
        load_config(with_stage(0, max_lookahead=-1))


def test_bad_dtype():
    with pytest.raises(ConfigError, match=r"stages\[1\]\.dtype: unknown dtype 'float8'"):
        load_config(with_stage(1, dtype="float8"))


@pytest.mark.parametrize(
    "sampling, message",
    [
        ({"temperature": -0.5}, r"sampling: temperature must be >= 0, got -0\.5"),
        ({"top_p": 0.0}, r"sampling: top_p must be in \(0, 1\], got 0\.0"),
        ({"top_p": 1.5}, r"sampling: top_p must be in \(0, 1\], got 1\.5"),
        ({"top_k": -2}, r"sampling: top_k must be >= 0, got -2"),
        ({"verify": "speculate"}, r"sampling\.verify: unknown mode 'speculate'"),
        ({"temprature": 1.0}, r"sampling: unknown key 'temprature' \(did you mean 'temperature'\?\)"),
        ({"temperature": "hot"}, r"sampling\.temperature: expected float, got 'hot'"),
    ],
)
def test_bad_sampling(sampling, message):
    with pytest.raises(ConfigError, match=message):
        load_config(mock_config(sampling=sampling))


def test_duplicate_stage_names():
    with pytest.raises(ConfigError, match=r"duplicate stage name 'target'"):
        load_config(with_stage(0, name="target"))


def test_ngram_stage_must_be_first(tmp_path):
    config = {
        "stages": [
            {"name": "drafter", "kind": "causal_lm", "model": str(tmp_path)},
            {"name": "lookup", "kind": "ngram"},
            {"name": "target", "kind": "causal_lm", "model": str(tmp_path)},
        ]
    }
    with pytest.raises(ConfigError, match=r"stages\[1\] \(lookup\): kind 'ngram' has no model .* can only be first"):
        load_config(config)


def test_mock_stage_followed_by_non_mock(tmp_path):
    config = {
        "stages": [
            {"name": "drafter", "kind": "mock"},
            {"name": "target", "kind": "causal_lm", "model": str(tmp_path)},  # a real directory
        ]
    }
    with pytest.raises(ConfigError, match=r"stages\[0\] \(drafter\): a mock stage .* must be mocks too"):
        load_config(config)


def test_mock_stages_with_different_vocab_sizes():
    with pytest.raises(ConfigError, match=r"different vocab_size"):
        load_config(with_stage(0, vocab_size=32))


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"agreement": 1.5}, r"stages\[0\]\.agreement: must be in \[0, 1\], got 1\.5"),
        ({"agreement": -0.1}, r"stages\[0\]\.agreement: must be in \[0, 1\], got -0\.1"),
        ({"latency_ms": -1}, r"stages\[0\]\.latency_ms / per_token_ms: must be >= 0"),
        ({"vocab_size": 1}, r"stages\[0\]\.vocab_size: must be >= 2, got 1"),
        ({"eos_token_id": 64}, r"stages\[0\]\.eos_token_id: 64 is outside the vocabulary"),
        ({"max_batch": 0}, r"stages\[0\]\.max_batch: must be >= 1 request a forward, got 0"),
    ],
)
def test_mock_options_out_of_range(changes, message):
    with pytest.raises(ConfigError, match=message):
        load_config(with_stage(0, **changes))


def test_only_a_kind_that_batches_takes_a_max_batch_above_one():
    assert load_config(with_stage(0, max_batch=16)).stages[0].max_batch == 16
    assert load_config({"stages": [{"name": "t", "kind": "mock"}]}).stages[0].max_batch == 1
    config = {"stages": [{"name": "lookup", "kind": "ngram", "max_batch": 4}, {"name": "t", "kind": "mock"}]}
    with pytest.raises(
        ConfigError,
        match=r"stages\[0\]\.max_batch: kind 'ngram' carries one request a forward \(only causal_lm, dream, vlm, mock batch\), got 4",
    ):
        load_config(config)


@pytest.mark.parametrize(
    "index, changes, message",
    [
        (0, {"relay_above": 1}, r"stages\[0\]\.relay_above: only a middle stage .* stage 'tiny' is the first, got 1"),
        (2, {"relay_above": 1}, r"stages\[2\]\.relay_above: only a middle stage .* stage 'target' is the target, got 1"),
        (1, {"relay_above": -1}, r"stages\[1\]\.relay_above: must be >= 0 requests open, got -1"),
        (1, {"relay_above": "many"}, r"stages\[1\]\.relay_above"),
        (1, {"relay_above": 4, "predraft": 2}, r"stages\[1\]\.relay_above: a stage that pre-drafts \(predraft 2\) does not"),
    ],
)
def test_only_a_middle_stage_relays_and_its_threshold_is_a_count(index, changes, message):
    def chain(index=1, **changes):
        stages = [{"name": name, "kind": "mock", "vocab_size": 64} for name in ("tiny", "mid", "target")]
        stages[index].update(changes)
        return {"stages": stages}

    assert load_config(chain(relay_above=4)).stages[1].relay_above == 4
    assert load_config(chain()).stages[1].relay_above is None
    with pytest.raises(ConfigError, match=message):
        load_config(chain(index, **changes))

    pair = sub_pipeline(load_config(chain(relay_above=4)), ["mid", "target"])  # mid is first there: it relays nothing
    assert [s.relay_above for s in pair.stages] == [None, None]
    whole = sub_pipeline(load_config(chain(relay_above=4)), ["tiny", "mid", "target"])
    assert [s.relay_above for s in whole.stages] == [None, 4, None]
    assert sub_pipeline(load_config(chain()), ["tiny", "mid"]).target.name == "mid"  # a drafter alone may be cut off


@pytest.mark.parametrize(
    "index, changes, message",
    [
        (0, {"tree": {}}, r"stages\[0\]\.tree: only the stage right before the target offers trees; 'tiny' is followed by 'mid'"),
        (2, {"tree": {}}, r"stages\[2\]\.tree: only the stage right before the target .* 'target' is the target"),
        (1, {"tree": {"budget": 0}}, r"stages\[1\]\.tree\.budget: must be >= 1, got 0"),
        (1, {"tree": {"branching": 1}}, r"stages\[1\]\.tree\.branching: must be >= 2, got 1"),
        (1, {"tree": {"branching": "two"}}, r"stages\[1\]\.tree\.branching: expected int, got 'two'"),
        (1, {"tree": {"temperature": 0}}, r"stages\[1\]\.tree\.temperature: must be a finite number > 0, got 0"),
        (1, {"tree": {"temperature": float("inf")}}, r"stages\[1\]\.tree\.temperature: must be a finite number > 0, got inf"),
        (1, {"tree": {"width": 8}}, r"stages\[1\]\.tree: unknown key 'width' \(did you mean 'depth'\?\)"),
        (1, {"tree": 7}, r"stages\[1\]\.tree: must be a mapping of budget, depth, branching, temperature, got 7"),
        (1, {"tree": {}, "predraft": 2}, r"stages\[1\]\.tree: a stage that pre-drafts \(predraft 2\) offers no trees"),
    ],
)
def test_only_the_stage_right_before_the_target_offers_trees(index, changes, message):
    def chain(index=1, **changes):
        stages = [{"name": name, "kind": "mock", "vocab_size": 64} for name in ("tiny", "mid", "target")]
        stages[index].update(changes)
        return {"stages": stages}

    assert load_config(chain(tree={"budget": 6, "branching": 3})).stages[1].tree == TreeShape(budget=6, branching=3)
    assert load_config(chain()).stages[1].tree is None
    with pytest.raises(ConfigError, match=message):
        load_config(chain(index, **changes))


def test_a_tree_fits_the_targets_widest_forward(family):
    def pair(target: dict, budget: int) -> dict:
        return {"stages": [{"name": "tiny", "kind": "causal_lm", "model": family["tiny"], "tree": {"budget": budget}}, target]}

    model = {"name": "target", "kind": "causal_lm", "model": family["target"]}
    assert load_config(pair(model, 7)).stages[0].tree.budget == 7
    with pytest.raises(ConfigError, match=r"stages\[0\]\.tree\.budget: 8 nodes and the root exceed the target's max_width of 8"):
        load_config(pair(model, 8))
    assert load_config(pair(dict(model, max_width=16), 15)).stages[0].tree.budget == 15


def test_ngram_options_out_of_order():
    config = {"stages": [{"name": "lookup", "kind": "ngram", "min_n": 3, "max_n": 2}, {"name": "t", "kind": "mock"}]}
    with pytest.raises(ConfigError, match=r"need 1 <= min_n <= max_n, got 3, 2"):
        load_config(config)


def test_yaml_path_that_does_not_exist(tmp_path):
    path = tmp_path / "missing.yaml"
    with pytest.raises(ConfigError, match=r"config file .*missing\.yaml.* does not exist"):
        load_config(path)


def test_invalid_yaml_text(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("stages: [\n  {name: a, kind: mock\n")
    with pytest.raises(ConfigError, match=r"config file .*broken\.yaml.* is not valid YAML"):
        load_config(path)


def test_yaml_that_is_not_a_mapping(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match=r"must be a mapping, got list"):
        load_config(path)


@pytest.mark.parametrize("stages", [None, [], "mock"])
def test_stages_must_be_a_non_empty_list(stages):
    with pytest.raises(ConfigError, match=r"config\.stages: must be a non-empty list"):
        load_config(mock_config(stages=stages))


@pytest.mark.parametrize("port", [-1, 65536, 100000])
def test_port_out_of_range(port):
    with pytest.raises(ConfigError, match=rf"server\.port: {port} is not a TCP port"):
        load_config(mock_config(server={"port": port}))


@pytest.mark.parametrize(
    "config, message",
    [
        (with_stage(0, max_lookahead=True), r"stages\[0\]\.max_lookahead: expected int, got True"),
        (with_stage(0, vocab_size=False), r"stages\[0\]\.vocab_size: expected int, got False"),
        (mock_config(server={"port": True}), r"server\.port: expected int, got True"),
        (mock_config(sampling={"seed": True}), r"sampling\.seed: expected int, got True"),
        (mock_config(sampling={"temperature": True}), r"sampling\.temperature: expected float, got True"),
    ],
)
def test_bool_where_number_expected(config, message):
    with pytest.raises(ConfigError, match=message):
        load_config(config)


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


def test_an_ngram_stage_alone_is_refused_as_a_target():
    with pytest.raises(ConfigError, match=r"stages\[0\] \(lookup\): kind 'ngram' only drafts; it cannot be the target"):
        load_config({"stages": [{"name": "lookup", "kind": "ngram"}]})


# --- devices ------------------------------------------------------------------------------------


def three_mock_stages(**groups):
    config = mock_config()
    config["stages"].insert(0, {"name": "tiny", "kind": "mock", "agreement": 0.5, "vocab_size": 64})
    for stage in config["stages"]:
        if stage["name"] in groups:
            stage["device_group"] = groups[stage["name"]]
    return config


def test_each_stage_has_a_device_of_its_own_by_default():
    config = load_config(three_mock_stages())
    assert config.devices() == ((0,), (1,), (2,))
    assert [s.group for s in config.stages] == ["tiny", "drafter", "target"]


def test_stages_of_one_device_group_share_a_device():
    config = load_config(three_mock_stages(tiny="drafters", drafter="drafters"))
    assert config.devices() == ((0, 1), (2,))
    assert load_config(three_mock_stages(tiny="target")).devices() == ((0, 2), (1,))  # a stage's name is its device


def test_one_device_has_one_set_of_resources():
    config = three_mock_stages(tiny="drafters", drafter="drafters")
    config["stages"][1]["resources"] = {"num_cpus": 2}
    with pytest.raises(ConfigError, match=r"'tiny' and 'drafter' share device group 'drafters' but not their resources"):
        load_config(config)


@pytest.mark.parametrize("device", ["gpu", "cuda:x", "cuda0", ""])
def test_unknown_device_is_named(device):
    with pytest.raises(ConfigError, match=rf"stages\[1\]\.device: unknown device '{device}'; expected cpu, cuda or cuda:N"):
        load_config(with_stage(1, device=device))


def test_cuda_devices_parse():
    assert load_config(with_stage(1, device="cuda:1")).target.device == "cuda:1"
    assert load_config(with_stage(0, device="cuda")).stages[0].device == "cuda"


def test_a_stage_on_a_gpu_reserves_one():
    config = load_config(with_stage(1, device="cuda"))
    assert config.target.resources == {"num_cpus": 1, "num_gpus": 1}
    assert config.stages[0].resources == {"num_cpus": 1}
    shared = load_config(with_stage(1, device="cuda:0", resources={"num_cpus": 2, "num_gpus": 0.5}))
    assert shared.target.resources == {"num_cpus": 2, "num_gpus": 0.5}


@pytest.mark.parametrize("resources", [{"num_cpus": 2}, {"num_cpus": 1, "num_gpus": 0}])
def test_a_stage_on_a_gpu_without_one_in_its_resources_is_named(resources):
    with pytest.raises(
        ConfigError, match=r"stages\[1\]\.resources: stage 'target' runs on device 'cuda' but its resources .* reserve no GPU"
    ):
        load_config(with_stage(1, device="cuda", resources=resources))


def test_empty_device_group_is_refused():
    with pytest.raises(ConfigError, match=r"stages\[0\]\.device_group: must be a non-empty name"):
        load_config(with_stage(0, device_group=""))


def test_cpus_counts_each_device_once():
    config = three_mock_stages(tiny="drafters", drafter="drafters")
    assert load_config(config).cpus() == 2  # drafters share one core, the target has one


def test_limits_and_faults_sections_parse_with_safe_defaults():
    config = load_config(mock_config(limits={"image_bytes": 1024, "requests_per_client": 2}, faults={"restore_s": 5}))
    assert config.limits == LimitsSpec(image_bytes=1024, requests_per_client=2)
    assert config.faults == FaultSpec(restore_s=5.0)
    assert load_config(mock_config()).limits == LimitsSpec()


@pytest.mark.parametrize(
    "section, why",
    [
        ({"limits": {"image_bytes": 0}}, r"limits\.image_bytes: must be positive, got 0"),
        ({"limits": {"image_bytes": 1.5}}, r"limits\.image_bytes: expected int, got 1\.5"),
        ({"limits": {"imge_bytes": 1}}, r"imge_bytes"),
        ({"faults": {"restore_s": -1.0}}, r"faults\.restore_s: must be positive, got -1\.0"),
        ({"faults": 3}, r"config\.faults: must be a mapping"),
    ],
)
def test_limits_and_faults_refuse_bad_values(section, why):
    with pytest.raises(ConfigError, match=why):
        load_config(mock_config(**section))


def test_zero_restarts_is_allowed_negative_is_not():
    assert load_config(mock_config(faults={"max_restarts": 0})).faults.max_restarts == 0
    with pytest.raises(ConfigError, match=r"faults\.max_restarts: must be >= 0, got -1"):
        load_config(mock_config(faults={"max_restarts": -1}))


def test_an_edited_config_is_checked_as_a_loaded_one():
    """`with_stages` holds stages edited with `dataclasses.replace` to a loaded stage's rules and the chain's."""
    replace = dataclasses.replace
    config = load_config({"stages": [{"name": "d", "kind": "mock", "predraft": 2}, {"name": "t", "kind": "mock"}]})
    d, t = config.stages
    assert with_stages(config, [replace(d, max_lookahead=3), t]).stages[0].max_lookahead == 3
    with pytest.raises(ConfigError, match=r"stages\[0\]\.tree: a stage that pre-drafts \(predraft 2\) offers no trees"):
        with_stages(config, [replace(d, tree=TreeShape()), t])
    with pytest.raises(ConfigError, match=r"stages\[1\]\.resources: stage 't' runs on device 'cuda' but .* reserve no GPU"):
        with_stages(config, [d, replace(t, device="cuda")])
    with pytest.raises(ConfigError, match=r"stages\[1\]\.tree: only the stage right before the target offers trees"):
        with_stages(config, [d, replace(t, tree=TreeShape())])  # the chain's rules too
