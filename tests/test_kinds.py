"""The table of stage kinds: one entry per kind a config accepts, capability flags that say what its
stages and sessions are, one builder per kind, and a table (with the config validated through it) that
stays torch-free."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pipespec import LocalPipeline
from pipespec.config import ConfigError, load_config
from pipespec.engine.stage import CommitLearner, FeatureReader, FeatureSource
from pipespec.protocol.messages import RequestSpec
from pipespec.protocol.params import SamplingParams
from pipespec.schema.kinds import KINDS, kind_of
from pipespec.stages.build import BUILDERS, MODULES

USER_KINDS = ("causal_lm", "ngram", "stand", "dream", "vlm", "mock")  # as design section 6 and the config's errors list them


def test_every_kind_a_config_accepts_has_one_entry_in_the_order_errors_list_them():
    assert tuple(KINDS) == USER_KINDS
    assert [kind.name for kind in KINDS.values()] == list(USER_KINDS)
    assert set(BUILDERS) == set(MODULES) == set(KINDS)  # every kind is built by its stage class, from its module
    with pytest.raises(ConfigError, match=r"unknown kind 'lstm'; expected one of causal_lm, ngram, stand, dream, vlm, mock$"):
        load_config({"stages": [{"name": "t", "kind": "lstm"}]})


def test_the_table_and_what_validates_through_it_import_without_torch():
    modules = (
        "pipespec.schema.kinds, pipespec.stages.build, pipespec.config, "
        "pipespec.requests.frontdoor, pipespec.requests.images, pipespec.requests.tokenization"
    )
    code = f"import sys, {modules}\nassert 'torch' not in sys.modules, 'torch was imported'"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_kinds_capabilities_are_what_its_stages_and_sessions_have(llava_dream_zoo):
    """Three chains built from their configs hold every kind: each session reads or gives the target's features and
    learns from commits exactly when its kind says so, and the front door takes images exactly when the target's
    kind does."""
    model = lambda name, kind: {"name": name, "kind": kind, "model": llava_dream_zoo[name], "dtype": "float32"}  # noqa: E731
    chains = [
        [model("tiny", "causal_lm"), model("dream", "dream"), model("target", "vlm")],
        [{"name": "lookup", "kind": "ngram"}, {"name": "toy", "kind": "mock", "vocab_size": 64}],
        [{"name": "stand", "kind": "stand"}, {"name": "toy", "kind": "mock", "vocab_size": 64}],
    ]
    seen = set()
    for stages in chains:
        config = load_config({"stages": stages})
        pipe = LocalPipeline(config)  # never started: its stages and front door
        for spec, stage in zip(config.stages, pipe.stages):
            kind = kind_of(spec)
            session = stage.open(RequestSpec("r", (1, 2, 3), SamplingParams(), 4))
            assert isinstance(session, FeatureReader) == kind.reads_target_features, spec.kind
            assert isinstance(session, FeatureSource) == kind.gives_target_features, spec.kind
            assert isinstance(stage, CommitLearner) == kind.learns_from_commits, spec.kind
            session.close()
            seen.add(spec.kind)
        assert pipe.front_door.target.takes_images == kind_of(config.target).takes_images
    assert seen == set(KINDS)
