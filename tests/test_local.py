"""LocalPipeline's front door: bad input fails clearly and early, stop rules, streaming, aborts.

Every bad value is an error that names it, raised before any model loads where possible, and a bad
request never disturbs the requests already running.
"""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from pipespec import ConfigError, LocalPipeline, load_config
from pipespec.stages.causal_lm import CausalLMStage
from tests.fixtures.toy_models import train_tokenizer


def text_config(family, names, **extra):
    return load_config(
        {"stages": [{"name": n, "kind": "causal_lm", "model": family[n], "dtype": "float32"} for n in names], **extra}
    )


@pytest.fixture(scope="module")
def pipe(family):
    with LocalPipeline(text_config(family, ["tiny", "target"])) as p:
        yield p


def test_unknown_kind_fails_before_loading():
    with pytest.raises(ConfigError, match="'causal-lm'.*did you mean 'causal_lm'"):
        load_config({"stages": [{"name": "t", "kind": "causal-lm", "model": "x"}]})


def test_missing_model_directory_is_named(tmp_path):
    missing = str(tmp_path / "nope")
    with pytest.raises(ConfigError, match="nope.*does not exist"):
        load_config({"stages": [{"name": "t", "kind": "causal_lm", "model": missing}]})


def test_tokenizer_mismatch_names_both_stages(family, tmp_path, monkeypatch):
    other = tmp_path / "other-tokenizer"
    train_tokenizer(vocab_size=400).save_pretrained(other)
    config = load_config(
        {
            "stages": [
                {"name": "d", "kind": "causal_lm", "model": str(other)},
                {"name": "t", "kind": "causal_lm", "model": family["target"]},
            ]
        }
    )
    monkeypatch.setattr(CausalLMStage, "__init__", lambda *a, **k: pytest.fail("a model loaded before the tokenizer check"))
    with pytest.raises(ConfigError, match=r"stages\[0\] \(d\).*other-tokenizer.*stage 't'"):
        LocalPipeline(config)


def test_vocabulary_mismatch_is_a_config_error():
    with pytest.raises(ConfigError, match="vocab_size"):
        load_config(
            {"stages": [{"name": "a", "kind": "mock", "vocab_size": 10}, {"name": "b", "kind": "mock", "vocab_size": 12}]}
        )


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_new_tokens=0), "max_new_tokens must be a positive integer, got 0"),
        (dict(max_new_tokens=-3), "got -3"),
        (dict(temperature=-0.5), "temperature must be >= 0, got -0.5"),
        (dict(top_p=1.5), "top_p"),
        (dict(image="cat.png"), "does not take images"),
        (dict(max_new_tokens=600), "exceeds the context of 512"),
    ],
)
def test_bad_request_values_are_named(pipe, kwargs, message):
    with pytest.raises(ValueError, match=message):
        pipe.generate("the red circle", **kwargs)


def test_max_new_tokens_none_is_the_room_the_context_leaves_and_left_out_is_64(pipe):
    """None: as many as the limits allow, here the room the target's context (512) leaves after the
    prompt (under limits.max_new_tokens, 8192); the keyword left out: the documented default, 64."""
    assert pipe.request(prompt_token_ids=[1, 40, 50], max_new_tokens=None)[0].max_new_tokens == 512 - 3
    assert pipe.request(prompt_token_ids=[1, 40, 50])[0].max_new_tokens == 64


def test_bad_prompts(pipe):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        pipe.generate(prompt_token_ids=[1, 10**6])
    with pytest.raises(ValueError, match="empty"):
        pipe.generate(prompt_token_ids=[])
    with pytest.raises(ValueError, match="exactly one"):
        pipe.generate("a", prompt_token_ids=[1])


def test_a_bad_request_does_not_disturb_running_ones(pipe):
    ids = [1, 40, 50, 60]
    want = pipe.generate(prompt_token_ids=ids, max_new_tokens=30).token_ids
    running = [pipe.submit(prompt_token_ids=ids, max_new_tokens=30) for _ in range(4)]
    for bad in (dict(max_new_tokens=0), dict(temperature=-1.0), dict(max_new_tokens=10_000)):
        with pytest.raises(ValueError):
            pipe.submit(prompt_token_ids=ids, **bad)
    assert [f.result().token_ids for f in running] == [want] * 4


def test_text_prompt_and_text_output(pipe, family):
    tok = AutoTokenizer.from_pretrained(family["target"])
    r = pipe.generate("the red circle", max_new_tokens=12)
    assert r.token_ids[:1] and r.text == tok.decode(r.token_ids, skip_special_tokens=True)
    assert r.finish_reason == "length" and len(r.token_ids) == 12
    assert r.stats.prefill_s > 0 and r.stats.decode_s > 0 and r.stats.generated_tokens == 12


def test_stop_string_cuts_text_and_stops(pipe):
    full = pipe.generate(prompt_token_ids=[1, 40, 50], max_new_tokens=30)
    stop = full.text[10:13]
    assert stop
    cut = pipe.generate(prompt_token_ids=[1, 40, 50], max_new_tokens=30, stop=[stop])
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.index(stop)]
    assert cut.token_ids == full.token_ids[: len(cut.token_ids)] and len(cut.token_ids) < 30


def test_eos_stops_generation():
    config = load_config(
        {"stages": [{"name": f"m{i}", "kind": "mock", "vocab_size": 8, "eos_token_id": 3, "agreement": 0.8} for i in range(2)]}
    )
    with LocalPipeline(config) as p:
        outs = [p.generate(prompt_token_ids=[s % 8, 1], max_new_tokens=200, seed=s, temperature=1.0) for s in range(8)]
    assert all(o.finish_reason == "stop" and o.token_ids[-1] == 3 and 3 not in o.token_ids[:-1] for o in outs)


def test_streamed_deltas_add_up(pipe):
    deltas = list(pipe.stream(prompt_token_ids=[1, 40, 50], max_new_tokens=25))
    whole = pipe.generate(prompt_token_ids=[1, 40, 50], max_new_tokens=25)
    assert [t for d in deltas for t in d.token_ids] == whole.token_ids
    assert "".join(d.text for d in deltas) == whole.text
    assert deltas[-1].finish_reason == "length" and deltas[-1].stats is not None
    assert all(d.finish_reason is None for d in deltas[:-1])


def test_abandoned_stream_is_dropped_everywhere(pipe):
    stream = pipe.stream(prompt_token_ids=[1, 40, 50], max_new_tokens=400)
    next(stream)
    stream.close()  # the client goes away mid-answer
    after = pipe.generate(prompt_token_ids=[1, 40, 51], max_new_tokens=10)
    assert after.finish_reason == "length"
    assert all(not runner.requests for runner in pipe.runners)
    assert not pipe.coordinator.live


def test_a_pipeline_not_running_says_so():
    config = load_config({"stages": [{"name": "target", "kind": "mock", "vocab_size": 50}]})
    idle = LocalPipeline(config)
    with pytest.raises(RuntimeError, match="not running: use `with LocalPipeline"):
        idle.generate(prompt_token_ids=[1, 2, 3], max_new_tokens=4)
    with idle:
        assert len(idle.generate(prompt_token_ids=[1, 2, 3], max_new_tokens=4).token_ids) == 4
    with pytest.raises(RuntimeError, match="not running"):  # closed
        next(idle.stream(prompt_token_ids=[1, 2, 3], max_new_tokens=4))
