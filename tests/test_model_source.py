"""A stage's `model` as a Hugging Face hub id, resolved from the local cache offline (pipespec.schema.model_source).

The cache is built here: toy models saved with `save_pretrained` (tests/fixtures/toy_models), laid out
as the hub's cache lays out a download (`models--org--name/blobs/<sha256>`, `snapshots/<commit>/<file>`
linking to them, `refs/<branch>` naming the commit) under a temporary HF_HUB_CACHE. A config naming the
ids loads through the real loading code and generates what the same models named by directory do; a
revision picks its snapshot; an id not in the cache, a revision not in it, and a revision given with a
directory are config errors naming the value and the cache.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import huggingface_hub.constants
import pytest

from pipespec import LocalPipeline, load_config
from pipespec.errors import ConfigError

MAIN = "a" * 40  # commit hashes
OLDER = "b" * 40


def cache_as_hub(model: Path, cache: Path, repo_id: str, commit: str, ref: str = "main") -> Path:
    """Put the files of the saved model `model` in `cache` as the hub's download of `repo_id` at `commit`,
    `ref` naming it; -> the snapshot directory."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    for file in sorted(p for p in model.rglob("*") if p.is_file()):
        data = file.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / file.relative_to(model)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))  # as the hub links them
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture
def hub_cache(tmp_path, monkeypatch) -> Path:
    """An empty hub cache of this test's, where the process looks: huggingface_hub reads HF_HUB_CACHE once,
    when imported, so its constant is pointed here as the variable set before the process started would."""
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    return cache


def two_stages(tiny: str, target: str, **target_keys) -> dict:
    stages = [
        {"name": "tiny", "kind": "causal_lm", "model": tiny, "dtype": "float32"},
        {"name": "target", "kind": "causal_lm", "model": target, "dtype": "float32", **target_keys},
    ]
    return {"name": "hub", "stages": stages}


def test_a_config_naming_hub_ids_in_the_cache_loads_and_generates_as_the_directories_do(family, hub_cache):
    tiny = cache_as_hub(Path(family["tiny"]), hub_cache, "toy-org/tiny", MAIN)
    target = cache_as_hub(Path(family["target"]), hub_cache, "toy-org/target", MAIN)
    config = load_config(two_stages("toy-org/tiny", "toy-org/target"))
    assert [s.model for s in config.stages] == [str(tiny), str(target)]
    asked = dict(prompt_token_ids=[5, 6, 7, 8], max_new_tokens=12)
    with LocalPipeline(config) as pipe:
        from_hub = pipe.generate(**asked)
    with LocalPipeline(load_config(two_stages(family["tiny"], family["target"]))) as pipe:
        from_directories = pipe.generate(**asked)
    assert from_hub.token_ids == from_directories.token_ids and len(from_hub.token_ids) == 12


def test_a_revision_picks_its_snapshot_by_branch_tag_or_commit(family, hub_cache):
    cache_as_hub(Path(family["target"]), hub_cache, "toy-org/target", MAIN)
    older = cache_as_hub(Path(family["other"]), hub_cache, "toy-org/target", OLDER, ref="v1")
    for revision in ("v1", OLDER):
        config = load_config(two_stages(family["tiny"], "toy-org/target", revision=revision))
        assert config.stages[1].model == str(older)


def test_a_hub_id_not_in_the_cache_is_named_with_the_cache(hub_cache):
    with pytest.raises(ConfigError) as error:
        load_config({"stages": [{"name": "target", "kind": "causal_lm", "model": "Qwen/Qwen2.5-0.5B"}]})
    assert str(error.value) == (
        f"stages[0].model: 'Qwen/Qwen2.5-0.5B' is not a model directory, and as a Hugging Face hub id it is not in the "
        f"local cache {str(hub_cache)!r} (HF_HUB_CACHE / HF_HOME; nothing is downloaded); fetch it first "
        f"(`hf download Qwen/Qwen2.5-0.5B`), or give the model's directory"
    )


def test_a_revision_not_in_the_cache_is_named(family, hub_cache):
    cache_as_hub(Path(family["target"]), hub_cache, "toy-org/target", MAIN)
    with pytest.raises(ConfigError) as error:
        load_config(two_stages(family["tiny"], "toy-org/target", revision="v2"))
    assert str(error.value) == (
        f"stages[1].revision: Hugging Face hub id 'toy-org/target' is in the local cache {str(hub_cache)!r}, but not "
        f"its revision 'v2'; fetch it first (`hf download toy-org/target --revision v2`), or name a revision it has"
    )


@pytest.mark.parametrize(
    "stage, why",
    [
        (
            {"kind": "causal_lm", "model": "/no/such/model"},
            "stages[0].model: model directory '/no/such/model' does not exist (nor is it a Hugging Face hub id, org/name)",
        ),
        ({"kind": "mock", "revision": "main"}, "stages[0].revision: kind 'mock' takes no model, so no revision, got 'main'"),
        ({"kind": "causal_lm", "model": "toy-org/target", "revision": 3}, "stages[0].revision: expected str, got 3"),
    ],
)
def test_what_is_neither_a_directory_nor_a_hub_id_is_named(stage, why, hub_cache):
    with pytest.raises(ConfigError) as error:
        load_config({"stages": [{"name": "target", **stage}]})
    assert str(error.value) == why


def test_a_revision_with_a_directory_is_refused(family):
    with pytest.raises(ConfigError) as error:
        load_config(two_stages(family["tiny"], family["target"], revision="main"))
    assert str(error.value) == (
        f"stages[1].revision: 'main' is for a Hugging Face hub id, but {family['target']!r} is a directory"
    )
