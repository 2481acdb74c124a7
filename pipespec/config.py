"""Pipeline configs: the YAML of design section 6, validated once, here, into frozen dataclasses.

Every error names the offending key path and value (`stages[1].kind: unknown kind 'causal-lm' ...`),
and unknown keys are errors with a did-you-mean hint. Nothing downstream re-validates. What each
kind adds (its own keys, whether it loads a model, where in a chain it may sit) is asked of the
table of stage kinds, `pipespec.schema.kinds`. A stage's `model` is a directory that exists or a
Hugging Face hub id (`org/name`, at an optional `revision`) in the local cache, kept as the snapshot
directory it resolves to (`pipespec.schema.model_source`); whether their tokenizers agree is checked
by `pipespec.requests.tokenization` before any weights load.

A stage on a GPU (`device: cuda` or `cuda:N`) reserves one: its `resources` default to a CPU and a
GPU, and resources that reserve no GPU are an error. In process (`LocalPipeline`) resources are
not used, but a config says what each stage needs wherever it runs. Whether the GPU exists is asked
when the stage is built (pipespec.stages.device).
"""

from __future__ import annotations

import difflib
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import Field, asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import yaml

from pipespec.errors import ConfigError
from pipespec.protocol.params import SamplingParams, VerifyMode
from pipespec.protocol.tree_shape import TreeShape
from pipespec.schema.kinds import KINDS, MockOptions, ModelOptions, NgramOptions, StandOptions, kind_of
from pipespec.schema.model_source import model_dir

DTYPES = ("float32", "bfloat16", "float16")
DEFAULT_NAME = "pipeline"  # a config's name when it gives none


@dataclass(frozen=True)
class StageSpec:
    """One stage of a pipeline: a model (or a weightless drafter) in its own place of the chain. Each key's meaning is
    its field's `doc`, which `docs/config-reference.md` is generated from (`pipespec config --reference`)."""

    name: str = field(metadata={"doc": "the stage's name: in statistics, metrics, logs and errors", "shown": "stage<i>"})
    kind: str = field(metadata={"doc": "what runs there: " + ", ".join(KINDS) + " (each kind's own keys below)"})
    model: str | None = field(
        default=None,
        metadata={
            "doc": "a directory that from_pretrained loads, or a hub id (org/name) in the local Hugging Face cache: "
            "required by the kinds that load a model (causal_lm, dream, vlm), refused by the others"
        },
    )
    max_lookahead: int = field(
        default=8, metadata={"doc": "uncommitted tokens this stage may run ahead of its verifier", "least": 0}
    )
    verify_window: int | None = field(
        default=None,
        metadata={"doc": "most drafts one step verifies; null: half its drafter's max_lookahead", "least": 1},
    )
    dtype: str = field(default="bfloat16", metadata={"doc": "the weights' and activations' dtype", "choices": DTYPES})
    device: str = field(
        default="cpu",
        metadata={"doc": "cpu, cuda (the GPU Ray assigned to the stage's actor) or cuda:N (pipespec.stages.device)"},
    )
    resources: Mapping[str, float] = field(
        default_factory=lambda: {"num_cpus": 1},
        metadata={"doc": "its Ray actor's resources; on cuda, a GPU too (default there: {num_cpus: 1, num_gpus: 1})"},
    )
    device_group: str | None = field(
        default=None,
        metadata={"doc": "stages naming the same group share one device: one actor, one compute thread; null: its own"},
    )
    options: MockOptions | NgramOptions | StandOptions | ModelOptions | None = field(
        default=None, metadata={"doc": "the kind's own keys, beside these (KINDS[kind].options)"}
    )
    predraft: int = field(
        default=0,
        metadata={
            "doc": "branches a drafter pre-drafts per request for the verdicts it expects (pipespec.engine.outcome_cache); "
            "0: none",
            "least": 0,
            "unit": "branches",
        },
    )
    max_batch: int = field(
        default=1,
        metadata={
            "doc": "most requests one forward carries, where the kind batches (causal_lm, vlm, dream, mock); 1: one a forward",
            "least": 1,
            "unit": "request a forward",
        },
    )
    adaptive_window: bool = field(
        default=True,
        metadata={
            "doc": "a batching verifier checks, per forward, only the drafts that pay for their rows (pipespec.engine."
            "verify_budget); false: its whole verify window"
        },
    )
    relay_above: int | None = field(
        default=None,
        metadata={
            "doc": "a middle stage passes its drafter's drafts on unchecked, without a forward, while more than this many "
            "requests go on there; null: it always checks them",
            "least": 0,
            "unit": "requests open",
        },
    )
    tree: TreeShape | None = field(
        default=None,
        metadata={
            "doc": "the stage right before the target offers draft trees: its drafts come with their likeliest siblings, "
            "checked in one tree forward (greedy and coupled sampling); null: chains"
        },
    )

    @property
    def group(self) -> str:
        """The device this stage runs on: its device group, or a device of its own."""
        return self.device_group if self.device_group is not None else self.name


@dataclass(frozen=True)
class SamplingSpec:
    """Defaults for requests that do not set them; `verify` is a property of the pipeline."""

    temperature: float = field(default=0.0, metadata={"doc": "0: greedy"})
    top_p: float = field(default=1.0, metadata={"doc": "nucleus sampling's mass; 1: off"})
    top_k: int = field(default=0, metadata={"doc": "sample among the k likeliest tokens; 0: off"})
    seed: int = field(default=0, metadata={"doc": "a request's seed when it sets none (not over HTTP: see docs/serving.md)"})
    verify: VerifyMode = field(
        default=VerifyMode.COUPLED,
        metadata={"doc": "how a verifier checks sampled drafts: coupled (shared noise) or rejection (rejection sampling)"},
    )

    def params(self, **overrides: Any) -> SamplingParams:
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values.update({k: v for k, v in overrides.items() if v is not None})
        return SamplingParams(**values)


@dataclass(frozen=True)
class ServerSpec:
    """Where the coordinator listens."""

    host: str = field(default="127.0.0.1", metadata={"doc": "the address every server binds (loopback by default)"})
    port: int = field(default=50051, metadata={"doc": "the coordinator's gRPC port (pipespec serve, pipespec.cluster.launch)"})


@dataclass(frozen=True)
class LimitsSpec:
    """Every input has a limit (design 5c); a refusal is an error naming the limit and the value."""

    image_bytes: int = field(default=16 * 2**20, metadata={"doc": "an encoded image"})
    image_pixels: int = field(
        default=25_000_000, metadata={"doc": "width x height, read from the image's header before it is decoded"}
    )
    prompt_tokens: int = field(default=32_768, metadata={"doc": "a prompt's tokens (image tokens included)"})
    max_new_tokens: int = field(
        default=8192, metadata={"doc": "what one request may ask for (the target's context may allow less)"}
    )
    stop_strings: int = field(default=16, metadata={"doc": "stop strings per request"})
    stop_chars: int = field(default=256, metadata={"doc": "characters per stop string"})
    requests_per_client: int = field(
        default=128, metadata={"doc": "requests in flight per client connection (a process's Clients share one)"}
    )
    frame_bytes: int = field(
        default=256 * 2**20,
        metadata={"doc": "the largest pipeline frame (an Open with its image, a prefill's features)"},
    )


@dataclass(frozen=True)
class FaultSpec:
    """How the runtime notices a lost stage and how long it waits for it to come back (design 5c)."""

    detect_s: float = field(
        default=2.0, metadata={"doc": "a silent link (no keepalive answer) is declared lost after about this long"}
    )
    restore_s: float = field(
        default=20.0,
        metadata={"doc": "a request waits this long for a lost stage to be restored, then fails naming it"},
    )
    max_restarts: int = field(default=3, metadata={"doc": "Ray restarts of each stage actor and of the coordinator", "least": 0})


@dataclass(frozen=True)
class PipelineConfig:
    """A pipeline: its stages and the sections every stage shares."""

    name: str = field(metadata={"doc": "the pipeline's name: the model id it serves over HTTP", "shown": DEFAULT_NAME})
    stages: tuple[StageSpec, ...] = field(metadata={"doc": "upstream to downstream; the last is the target"})
    sampling: SamplingSpec = field(default=SamplingSpec(), metadata={"doc": "defaults for requests that do not set them"})
    server: ServerSpec = field(default=ServerSpec(), metadata={"doc": "where the coordinator listens"})
    limits: LimitsSpec = field(default=LimitsSpec(), metadata={"doc": "every input's limit; a refusal names it"})
    faults: FaultSpec = field(default=FaultSpec(), metadata={"doc": "how a lost stage is noticed and waited for"})

    @property
    def target(self) -> StageSpec:
        return self.stages[-1]

    def window(self, i: int) -> int:
        """Most drafts stage i verifies per step: the rest stay pending, so its drafter keeps
        drafting while it verifies (the drafter may run at most max_lookahead ahead)."""
        if i == 0:
            return 0
        spec = self.stages[i]
        return spec.verify_window if spec.verify_window is not None else max(1, self.stages[i - 1].max_lookahead // 2)

    def devices(self) -> tuple[tuple[int, ...], ...]:
        """The stages' indices on each device, devices in the order of their first stage."""
        groups: dict[str, list[int]] = {}
        for i, spec in enumerate(self.stages):
            groups.setdefault(spec.group, []).append(i)
        return tuple(tuple(g) for g in groups.values())

    def cpus(self) -> float:
        """The CPUs all its devices reserve (each device: its first stage's `num_cpus`)."""
        return sum(self.stages[d[0]].resources.get("num_cpus", 0) for d in self.devices())

    def sends_features(self, i: int) -> bool:
        """Stage i hands its features to its drafter, which reads them (a DREAM stage; pipespec.engine.handoff)."""
        return i > 0 and kind_of(self.stages[i - 1]).reads_target_features


def load_config(source: str | os.PathLike | Mapping[str, Any]) -> PipelineConfig:
    """Parse and validate a pipeline config from a YAML path or an already-parsed mapping."""
    if isinstance(source, Mapping):
        raw = source
    else:
        path = Path(source)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist")
        try:
            raw = yaml.safe_load(path.read_text())
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {str(path)!r} is not valid YAML: {e}") from e
    if not isinstance(raw, Mapping):
        raise ConfigError(f"a pipeline config must be a mapping, got {type(raw).__name__}")
    _reject_unknown(raw, [f.name for f in fields(PipelineConfig)], "config")

    stages_raw = raw.get("stages")
    if not isinstance(stages_raw, list) or not stages_raw:
        raise ConfigError("config.stages: must be a non-empty list of stages (the last one is the target)")
    stages = tuple(_stage(s, i) for i, s in enumerate(stages_raw))
    _check_chain(stages)
    return PipelineConfig(
        name=_typed(raw.get("name", DEFAULT_NAME), str, "config.name"),
        stages=stages,
        sampling=_sampling(raw.get("sampling") or {}),
        server=_server(raw.get("server") or {}),
        limits=_positive(raw.get("limits") or {}, LimitsSpec, "limits"),
        faults=_positive(raw.get("faults") or {}, FaultSpec, "faults"),
    )


def config_dict(config: PipelineConfig) -> dict[str, Any]:
    """`config` as the mapping `load_config` reads, every default filled in (a stage's kind options among its own
    keys, its model as the directory it loads): loading it again gives `config` (`pipespec config FILE` prints it)."""

    def stage(spec: StageSpec) -> dict[str, Any]:
        out = {f.name: getattr(spec, f.name) for f in fields(spec) if f.name != "options"}
        out["resources"] = dict(spec.resources)
        out["tree"] = asdict(spec.tree) if spec.tree is not None else None
        if spec.model is None:
            del out["model"]
        return out | (asdict(spec.options) if spec.options is not None else {})

    return {
        "name": config.name,
        "stages": [stage(s) for s in config.stages],
        "sampling": asdict(config.sampling) | {"verify": config.sampling.verify.value},
        "server": asdict(config.server),
        "limits": asdict(config.limits),
        "faults": asdict(config.faults),
    }


def _out_of_place(i: int, count: int) -> tuple[str, ...]:
    """The keys stage i of a chain of `count` stages cannot keep (taken from a longer chain): `relay_above` unless
    it is in the middle, `tree` unless it is right before the target."""
    return (("relay_above",) if not 0 < i < count - 1 else ()) + (("tree",) if i != count - 2 else ())


def sub_pipeline(config: PipelineConfig, names: Sequence[str]) -> PipelineConfig:
    """The pipeline of `config`'s stages named in `names`, kept in the config's order, the last of them its target
    (a drafter alone included), checked like a loaded config (`with_stages`); a name the config lacks is a
    ConfigError naming it. A stage no longer in the middle relays nothing, one no longer right before the target
    offers no trees."""
    known = [s.name for s in config.stages]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ConfigError(f"no stage named {unknown[0]!r} in pipeline {config.name!r} (stages: {', '.join(known)})")
    kept = [s for s in config.stages if s.name in names]
    if not kept:
        raise ConfigError(f"a sub-pipeline of {config.name!r} needs a stage, got none")
    stages = tuple(replace(s, **dict.fromkeys(_out_of_place(i, len(kept)))) for i, s in enumerate(kept))
    return with_stages(replace(config, name=f"{config.name}[{'->'.join(s.name for s in stages)}]"), stages)


def with_stages(config: PipelineConfig, stages: Sequence[StageSpec]) -> PipelineConfig:
    """`config` with these stages (edited with `dataclasses.replace`), checked as a loaded config's are: each stage's
    rules between its keys, then the chain's (places, trees, relays, one device's resources); a ConfigError says why."""
    stages = tuple(stages)
    for i, spec in enumerate(stages):
        _check_stage(spec, f"stages[{i}]")
    _check_chain(stages)
    return replace(config, stages=stages)


def _reject_unknown(raw: Mapping[str, Any], allowed: tuple[str, ...] | list[str], where: str) -> None:
    for key in raw:
        if key not in allowed:
            close = difflib.get_close_matches(str(key), allowed, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"{where}: unknown key {key!r}{hint}; allowed keys: {', '.join(allowed)}")


def _typed(value: Any, kind: type | tuple[type, ...], where: str) -> Any:
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kind):
        names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise ConfigError(f"{where}: expected {names}, got {value!r}")
    return value


# a stage's keys that its spec keeps in another form (a hub id's revision: in `model`, the directory it names)
STAGE_EXTRA_KEYS: Mapping[str, str] = {"revision": "with a hub id as `model`: its branch, tag or commit (default main)"}
# a stage's keys: its spec's fields (`options`: the kind's own, beside them) and those
STAGE_KEYS = (*(f.name for f in fields(StageSpec) if f.name != "options"), *STAGE_EXTRA_KEYS)


def _stage(raw: Any, i: int) -> StageSpec:
    where = f"stages[{i}]"
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where}: a stage must be a mapping, got {raw!r}")
    kind = raw.get("kind")
    names = tuple(KINDS)
    if kind not in names:
        close = difflib.get_close_matches(str(kind), names, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"{where}.kind: unknown kind {kind!r}{hint}; expected one of {', '.join(names)}")
    stage_kind = KINDS[kind]
    option_cls = stage_kind.options
    option_keys = [f.name for f in fields(option_cls)] if option_cls else []
    _reject_unknown(raw, [*STAGE_KEYS, *option_keys], f"{where} ({kind})")

    name = _typed(raw.get("name", f"stage{i}"), str, f"{where}.name")
    model = raw.get("model")
    if stage_kind.loads_model:
        if model is None:
            raise ConfigError(f"{where}.model: kind {kind!r} needs a model directory")
        model = _typed(model, str, f"{where}.model")
        revision = raw.get("revision")
        model = model_dir(model, None if revision is None else _typed(revision, str, f"{where}.revision"), where)
    elif model is not None:
        raise ConfigError(f"{where}.model: kind {kind!r} takes no model, got {model!r}")
    elif "revision" in raw:
        raise ConfigError(f"{where}.revision: kind {kind!r} takes no model, so no revision, got {raw['revision']!r}")

    declared = {f.name: f for f in fields(StageSpec)}
    lookahead, window, predraft, max_batch, adaptive, relay_above = (
        _declared(raw, declared[key], where)
        for key in ("max_lookahead", "verify_window", "predraft", "max_batch", "adaptive_window", "relay_above")
    )
    tree = _tree(raw.get("tree"), f"{where}.tree")
    dtype = raw.get("dtype", StageSpec.dtype)
    if dtype not in DTYPES:
        raise ConfigError(f"{where}.dtype: unknown dtype {dtype!r}; expected one of {', '.join(DTYPES)}")
    device = _typed(raw.get("device", StageSpec.device), str, f"{where}.device")
    if not re.fullmatch(r"cpu|cuda(:[0-9]+)?", device):
        raise ConfigError(f"{where}.device: unknown device {device!r}; expected cpu, cuda or cuda:N")
    group = raw.get("device_group")
    if group is not None:
        _typed(group, str, f"{where}.device_group")
    resources = raw.get("resources", {"num_cpus": 1, "num_gpus": 1} if device != "cpu" else {"num_cpus": 1})
    if not isinstance(resources, Mapping) or not all(
        isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 for k, v in resources.items()
    ):
        raise ConfigError(f"{where}.resources: must map resource names to non-negative numbers, got {resources!r}")

    options = None
    if option_cls is not None:
        values = {f.name: _typed(raw[f.name], _type_of(f), f"{where}.{f.name}") for f in fields(option_cls) if f.name in raw}
        options = option_cls(**values)
        options.check(where)
    spec = StageSpec(
        name,
        kind,
        model,
        lookahead,
        window,
        dtype,
        device,
        dict(resources),
        group,
        options,
        predraft,
        max_batch,
        adaptive,
        relay_above,
        tree,
    )
    _check_stage(spec, where)
    return spec


def _check_stage(spec: StageSpec, where: str) -> None:
    """The rules between a stage's own keys, for a stage loaded or edited (`with_stages`): a ConfigError naming the
    key."""
    kind = kind_of(spec)
    if spec.max_batch > 1 and not kind.batches:
        batching = ", ".join(name for name, k in KINDS.items() if k.batches)
        raise ConfigError(
            f"{where}.max_batch: kind {spec.kind!r} carries one request a forward (only {batching} batch), got {spec.max_batch}"
        )
    if spec.relay_above is not None and spec.predraft:
        raise ConfigError(
            f"{where}.relay_above: a stage that pre-drafts (predraft {spec.predraft}) does not relay, got {spec.relay_above}"
        )
    if spec.tree is not None and spec.predraft:
        raise ConfigError(f"{where}.tree: a stage that pre-drafts (predraft {spec.predraft}) offers no trees")
    if spec.device_group is not None and not spec.device_group:
        raise ConfigError(f"{where}.device_group: must be a non-empty name")
    if spec.device != "cpu" and not spec.resources.get("num_gpus"):
        raise ConfigError(
            f"{where}.resources: stage {spec.name!r} runs on device {spec.device!r} but its resources {dict(spec.resources)!r} "
            f"reserve no GPU; give num_gpus (stages sharing one GPU: one device_group, so they share one actor and one "
            f"compute thread)"
        )


_TYPES: Mapping[str, type | tuple[type, ...]] = {  # a declared field's type (its annotation) -> what a YAML value may be
    "str": str,
    "float": float,
    "int": int,
    "int | None": (int, type(None)),
    "float | None": (int, float, type(None)),
    "bool": bool,
    "bool | None": (bool, type(None)),
}


def _type_of(f: Field) -> type | tuple[type, ...]:
    return _TYPES[str(f.type)]


def _declared(raw: Mapping[str, Any], f: Field, where: str) -> Any:
    """Key `f.name` of `raw` (its declared default if unset), of its declared type and at least its `least`."""
    value = _typed(raw.get(f.name, f.default), _type_of(f), f"{where}.{f.name}")
    least = f.metadata.get("least")
    if value is not None and least is not None and value < least:
        unit = f.metadata.get("unit")
        raise ConfigError(f"{where}.{f.name}: must be >= {least}{' ' + unit if unit else ''}, got {value}")
    return value


def _tree(raw: Any, where: str) -> TreeShape | None:
    """A stage's `tree` section (None: none), its keys and values checked."""
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where}: must be a mapping of {', '.join(f.name for f in fields(TreeShape))}, got {raw!r}")
    _reject_unknown(raw, [f.name for f in fields(TreeShape)], where)
    for f in fields(TreeShape):
        if f.name in raw and "least" in f.metadata:
            _declared(raw, f, where)
    if "temperature" in raw and not 0 < _typed(raw["temperature"], (int, float), f"{where}.temperature") < math.inf:
        raise ConfigError(f"{where}.temperature: must be a finite number > 0, got {raw['temperature']}")
    return TreeShape(**raw)


def _check_tree(stages: tuple[StageSpec, ...], i: int) -> None:
    """A ConfigError unless stage i may offer trees: right before the target (every kind that can be one checks
    them: pipespec.engine.stage.DraftTreeSession), within the target's widest forward."""
    target, tree = stages[-1], stages[i].tree
    if i != len(stages) - 2:
        where = "the target" if i == len(stages) - 1 else f"followed by {stages[i + 1].name!r}, not the target"
        raise ConfigError(f"stages[{i}].tree: only the stage right before the target offers trees; {stages[i].name!r} is {where}")
    widest = getattr(target.options or ModelOptions(), "max_width", None)  # a mock's forwards have no widest
    if widest is not None and tree.budget + 1 > widest:
        raise ConfigError(
            f"stages[{i}].tree.budget: {tree.budget} nodes and the root exceed the target's max_width of {widest} rows a forward"
        )


def _check_chain(stages: tuple[StageSpec, ...]) -> None:
    names = [s.name for s in stages]
    for n in names:
        if names.count(n) > 1:
            raise ConfigError(f"stages: duplicate stage name {n!r}")
    for i, s in enumerate(stages):
        kind_of(s).place(stages, i)
        if s.tree is not None:
            _check_tree(stages, i)
        if s.relay_above is not None and not 0 < i < len(stages) - 1:
            raise ConfigError(
                f"stages[{i}].relay_above: only a middle stage (a drafter before it, a verifier after it) relays drafts; "
                f"stage {s.name!r} is the {'target' if i == len(stages) - 1 else 'first'}, got {s.relay_above}"
            )
    first: dict[str, StageSpec] = {}
    for s in stages:  # one device: one set of resources, one torch device
        lead = first.setdefault(s.group, s)
        for key in ("resources", "device"):
            if getattr(s, key) != getattr(lead, key):
                raise ConfigError(
                    f"stages {lead.name!r} and {s.name!r} share device group {s.group!r} but not their {key} "
                    f"({getattr(lead, key)!r} vs {getattr(s, key)!r}): one device has one"
                )


def _sampling(raw: Any) -> SamplingSpec:
    if not isinstance(raw, Mapping):
        raise ConfigError(f"config.sampling: must be a mapping, got {raw!r}")
    _reject_unknown(raw, [f.name for f in fields(SamplingSpec)], "sampling")
    verify = raw.get("verify", SamplingSpec.verify.value)
    try:
        mode = VerifyMode(verify)
    except ValueError:
        modes = " or ".join(m.value for m in VerifyMode)
        raise ConfigError(f"sampling.verify: unknown mode {verify!r}; expected {modes}") from None
    numbers = {f.name: _declared(raw, f, "sampling") for f in fields(SamplingSpec) if f.name != "verify"}
    spec = SamplingSpec(**numbers, verify=mode)
    try:
        spec.params()
    except ValueError as e:
        raise ConfigError(f"sampling: {e}") from None
    return spec


def _server(raw: Any) -> ServerSpec:
    if not isinstance(raw, Mapping):
        raise ConfigError(f"config.server: must be a mapping, got {raw!r}")
    _reject_unknown(raw, [f.name for f in fields(ServerSpec)], "server")
    spec = ServerSpec(**{f.name: _declared(raw, f, "server") for f in fields(ServerSpec)})
    if not 0 <= spec.port <= 65535:
        raise ConfigError(f"server.port: {spec.port} is not a TCP port")
    return spec


def _positive(raw: Any, cls: type, where: str) -> Any:
    """A section of numbers (`cls`'s fields, typed as their defaults), positive unless a field's metadata
    gives its `least`; unset keys keep the defaults."""
    if not isinstance(raw, Mapping):
        raise ConfigError(f"config.{where}: must be a mapping, got {raw!r}")
    _reject_unknown(raw, [f.name for f in fields(cls)], where)
    values = {}
    for f in fields(cls):
        if f.name in raw:
            value = _typed(raw[f.name], type(f.default), f"{where}.{f.name}")
            low = f.metadata.get("least")
            if not (value > 0 if low is None else value >= low):
                raise ConfigError(f"{where}.{f.name}: must be {'positive' if low is None else f'>= {low}'}, got {value!r}")
            values[f.name] = value
    return cls(**values)
