"""The run configuration: a dataclass schema and the layered merge that fills it.

Merge order (later wins)::

    schema defaults <- configs/defaults.yaml <- configs/recipes/<recipe>.yaml (``extends:`` chains, parent first)
        <- [registry ``tiny`` overrides when ``smoke=true``] <- --profile NAME ... <- --config FILE ...
        <- command-line ``key=value`` items

The merged tree is in struct mode: an unknown key is an error that names the nearest valid keys, a value of
the wrong type names the key and the type it expects (``stages: expected a list of strings, got 'fit'``), and
every error says which layer (file or command-line item) it came from. Each section checks its values in
``__post_init__`` (``trainer.max_epochs=-3: must be an integer >= -1 (-1: no limit) or null``), and
``checkpoint.monitor`` / an ``early_stopping`` monitor must match a metric the method declares it logs
(:attr:`recipes.registry.MethodSpec.logs`), so every ``key=value`` mistake fails here, before anything is built. ``method.args``, ``data.args`` and each callback's ``args`` are free-form here and are
validated against the component's own config class by :mod:`recipes.registry`; the validated args come back
complete (every field, defaults included) and replace the given ones, so ``config.yaml`` and the fingerprint
record every value a run used (provenance ``default`` for the values no layer set).

Command-line grammar:
    ``key=value``   YAML-typed assignment (``trainer.max_steps=100``, ``stages=[fit]``, ``name=null``)
    ``~key``        delete an entry of a free-form mapping (``~callbacks.lr``; ``~method.args.dropout`` restores
                    the config class's default)
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import yaml
from omegaconf import MISSING, DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from lightning_modules.optim import OptimConfig
from recipes import registry
from recipes.configio import (
    ConfigError,
    check_list_elements,
    config_dir,
    container_type_error,
    find_container_mismatch,
    friendly_error,
    read_yaml,
    recipe_chain,
)

__all__ = [
    "ComponentConfig",
    "TrainerConfig",
    "OptimConfig",
    "CheckpointConfig",
    "LoggingConfig",
    "RunConfig",
    "ConfigError",
    "DEFAULT",
    "Layer",
    "LoadedConfig",
    "config_dir",
    "load_config",
    "to_yaml",
    "config_differences",
]

_RUN_CONTROL_KEYS = ("name", "run_dir", "resume", "runs_root", "resume_mismatch")
"""Keys that say where and how a run runs, not what it computes: left out of the fingerprint and of the
comparison of a resumed checkpoint's config with the current one."""

# Lightning's precision inputs (``lightning.fabric.connector._PRECISION_INPUT``), without importing it.
PRECISIONS = ("transformer-engine", "transformer-engine-float16", "16-true", "16-mixed", "bf16-true", "bf16-mixed",
              "32-true", "64-true", "64", "32", "16", "bf16")
ACCELERATORS = ("auto", "cpu", "gpu", "cuda", "mps", "tpu", "hpu")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _raise(problems: List[str]) -> None:
    if problems:
        raise ConfigError("; ".join(problems))


def _devices_ok(devices: Any) -> bool:
    """Lightning's ``devices``: ``auto``, -1 (all), a count >= 1, a list of ids, or a string of them (``"0,1"``)."""
    if devices == "auto":
        return True
    if _is_int(devices):
        return devices == -1 or devices >= 1
    if isinstance(devices, (list, tuple)):
        return bool(devices) and all(_is_int(d) and d >= 0 for d in devices)
    if isinstance(devices, str):
        parts = [p.strip() for p in devices.split(",") if p.strip()]
        return bool(parts) and (parts == ["-1"] or all(p.isdigit() for p in parts))
    return False


def _trainer_problems(t: "TrainerConfig") -> List[str]:
    problems = []

    def need(ok: bool, name: str, valid: str) -> None:
        if not ok:
            problems.append(f"trainer.{name}={getattr(t, name)!r}: {valid}")

    need(t.accelerator in ACCELERATORS, "accelerator", f"expected one of {', '.join(ACCELERATORS)}")
    need(_devices_ok(t.devices), "devices", "expected auto, -1 (all), a count >= 1, or a list of device ids")
    need(_is_int(t.num_nodes) and t.num_nodes >= 1, "num_nodes", "must be an integer >= 1")
    need(isinstance(t.strategy, str) and bool(t.strategy.strip()), "strategy", "name a Lightning strategy (auto, ddp, ...)")
    need(str(t.precision) in PRECISIONS, "precision", f"expected one of {', '.join(PRECISIONS[:8])}")
    need(t.max_epochs is None or (_is_int(t.max_epochs) and t.max_epochs >= -1), "max_epochs",
         "must be an integer >= -1 (-1: no limit) or null")
    need(_is_int(t.max_steps) and t.max_steps >= -1, "max_steps", "must be an integer >= -1 (-1: no limit)")
    need(t.min_steps is None or (_is_int(t.min_steps) and t.min_steps >= 0), "min_steps", "must be an integer >= 0 or null")
    v = t.val_check_interval
    need(v is None or (_is_int(v) and v >= 1) or (isinstance(v, float) and 0.0 < v <= 1.0), "val_check_interval",
         "must be an integer >= 1 (batches), a fraction of an epoch in (0, 1], or null")
    need(t.check_val_every_n_epoch is None or (_is_int(t.check_val_every_n_epoch) and t.check_val_every_n_epoch >= 1),
         "check_val_every_n_epoch", "must be an integer >= 1 or null")
    for name in ("limit_train_batches", "limit_val_batches", "limit_test_batches", "limit_predict_batches"):
        v = getattr(t, name)
        need(v is None or (_is_int(v) and v >= 0) or (isinstance(v, float) and 0.0 <= v <= 1.0), name,
             "must be an integer >= 0 (batches), a fraction in [0, 1] (float), or null")
    need(_is_int(t.num_sanity_val_steps) and t.num_sanity_val_steps >= -1, "num_sanity_val_steps",
         "must be an integer >= -1 (-1: all)")
    need(_is_int(t.log_every_n_steps) and t.log_every_n_steps >= 1, "log_every_n_steps", "must be an integer >= 1")
    need(t.gradient_clip_val is None or (_is_number(t.gradient_clip_val) and t.gradient_clip_val >= 0),
         "gradient_clip_val", "must be a number >= 0 or null")
    need(_is_int(t.accumulate_grad_batches) and t.accumulate_grad_batches >= 1, "accumulate_grad_batches",
         "must be an integer >= 1")
    need(isinstance(t.fast_dev_run, bool) or (_is_int(t.fast_dev_run) and t.fast_dev_run >= 0), "fast_dev_run",
         "must be true, false or an integer >= 0")
    return problems


# ---------------------------------------------------------------------------------------------- schema
@dataclass
class ComponentConfig:
    """A registry component: its short name and its arguments (validated against its own config class)."""

    name: str = MISSING
    """Registry name, e.g. ``lcube`` (see ``python -m recipes.ls``)."""
    args: Dict[str, Any] = field(default_factory=dict)
    """Arguments of the component; checked against the component's config dataclass."""


@dataclass
class TrainerConfig:
    """The Lightning ``Trainer`` arguments litctx supports, with Lightning's meaning."""

    accelerator: str = "auto"
    """``cpu``, ``gpu``, ``cuda``, ``mps`` or ``auto``."""
    devices: Any = 1
    """Number of devices, a list of device ids, or ``auto``."""
    num_nodes: int = 1
    strategy: str = "auto"
    """``auto``, ``ddp``, ``fsdp``, ... (any Lightning strategy name)."""
    precision: str = "32-true"
    """``32-true``, ``16-mixed``, ``bf16-mixed``, ``64-true``."""
    max_epochs: Optional[int] = None
    max_steps: int = -1
    min_steps: Optional[int] = None
    val_check_interval: Optional[Union[int, float]] = None
    """Validate every N training batches (int) or fraction of an epoch (float)."""
    check_val_every_n_epoch: Optional[int] = 1
    limit_train_batches: Optional[Union[int, float]] = None
    limit_val_batches: Optional[Union[int, float]] = None
    limit_test_batches: Optional[Union[int, float]] = None
    limit_predict_batches: Optional[Union[int, float]] = None
    num_sanity_val_steps: int = 2
    log_every_n_steps: int = 50
    gradient_clip_val: Optional[float] = None
    accumulate_grad_batches: int = 1
    deterministic: Optional[bool] = None
    benchmark: Optional[bool] = None
    detect_anomaly: bool = False
    fast_dev_run: Union[int, bool] = False
    extra: Dict[str, Any] = field(default_factory=dict)
    """Any other ``Trainer`` keyword, passed through unchanged (the audited escape hatch)."""

    def __post_init__(self) -> None:
        _raise(_trainer_problems(self))


@dataclass
class CheckpointConfig:
    """Checkpointing: ``checkpoints/last.ckpt`` always, plus the best ``save_top_k`` by ``monitor``."""

    monitor: Optional[str] = None
    """Metric that defines "best" (e.g. ``val/loss``); null keeps the latest."""
    mode: str = "min"
    save_top_k: int = 1
    every_n_train_steps: Optional[int] = None
    every_n_epochs: Optional[int] = 1
    save_last: bool = True

    def __post_init__(self) -> None:
        problems = []
        if self.mode not in ("min", "max"):
            problems.append(f"checkpoint.mode={self.mode!r}: expected 'min' or 'max'")
        if not _is_int(self.save_top_k) or self.save_top_k < -1:
            problems.append(f"checkpoint.save_top_k={self.save_top_k!r}: must be an integer >= -1 (-1: keep all)")
        for name in ("every_n_train_steps", "every_n_epochs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 1):
                problems.append(f"checkpoint.{name}={value!r}: must be an integer >= 1 or null")
        if self.monitor is not None and not str(self.monitor).strip():
            problems.append("checkpoint.monitor='': name a logged metric (e.g. val/loss) or null")
        _raise(problems)


@dataclass
class LoggingConfig:
    """Logs always go to ``<run_dir>/logs/metrics.csv``; TensorBoard to ``<run_dir>/tb`` when installed."""

    progress: str = "auto"
    """``auto`` (a bar on a terminal, log lines otherwise), ``bar``, ``log`` or ``none``."""
    every_n_steps: int = 50
    """Interval of the progress log lines when the bar is off."""
    tensorboard: Optional[bool] = None
    """null: use TensorBoard when it is importable; true: require it; false: never."""

    def __post_init__(self) -> None:
        problems = []
        if self.progress not in ("auto", "bar", "log", "none"):
            problems.append(f"logging.progress={self.progress!r}: expected auto, bar, log or none")
        if not _is_int(self.every_n_steps) or self.every_n_steps < 1:
            problems.append(f"logging.every_n_steps={self.every_n_steps!r}: must be an integer >= 1")
        _raise(problems)


@dataclass
class FollowUpConfig:
    """A recipe that ``recipes.fit`` runs after this one, starting from this run's checkpoint (e.g. fine-tuning
    after pre-training). Its run directory is ``<this run>/then-<recipe>``."""

    recipe: Optional[str] = None
    """The follow-up recipe; null: none."""
    init_from: str = "best"
    """What the follow-up starts from: this run's ``best`` or ``last`` checkpoint (loaded as ``init_from``),
    ``none``, or ``export``: this run's exported model folder (``method.args.export_dir``) as the follow-up's
    ``method.args.model`` (a language model continued from the trained weights with another surgery, e.g. L2A
    added to a model trained from scratch, whose global path must copy the trained attention)."""
    inherit: List[str] = field(default_factory=list)
    """Dotted keys copied from this run's resolved config into the follow-up's (e.g. ``seed``, ``data.args.path``)."""
    overrides: List[str] = field(default_factory=list)
    """``key=value`` overrides of the follow-up, applied after the inherited keys."""
    baseline: bool = False
    """Also run the follow-up from scratch (as with ``init_from: none``, in ``<this run>/then-<recipe>-baseline``;
    it runs no follow-up of its own), then print both test results on the follow-up's checkpoint monitor and
    whether this run's checkpoint helped, and draw both validation curves (``<this run>/plots/baseline.png``)."""


@dataclass
class RunConfig:
    """Everything one run needs. Print a resolved one with ``python -m recipes.show RECIPE``."""

    recipe: str = MISSING
    """Recipe name (``configs/recipes/<recipe>.yaml``)."""
    description: str = ""
    seed: int = 0
    smoke: bool = False
    """Apply the registry's ``tiny`` overrides (sub-minute CPU runs for tests and notebooks)."""
    name: Optional[str] = None
    """Run name; default ``<UTC time>-<config fingerprint>``."""
    run_dir: Optional[str] = None
    """Explicit run directory (overrides ``runs_root``/``recipe``/``name``)."""
    runs_root: str = "runs"
    """Root of run directories (the ``LITCTX_RUNS_DIR`` environment variable overrides it)."""
    method: ComponentConfig = field(default_factory=ComponentConfig)
    data: ComponentConfig = field(default_factory=ComponentConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    callbacks: Dict[str, ComponentConfig] = field(default_factory=dict)
    """Extra callbacks keyed by a label, e.g. ``callbacks.lr={name: lr_monitor}``."""
    init_from: Optional[str] = None
    """Checkpoint to load weights from (weights only; not the optimizer or the step)."""
    init_strict: bool = True
    """Require the ``init_from`` state dict to match the model exactly."""
    resume: Optional[str] = None
    """``auto`` (continue the latest interrupted run of this config, or start fresh) or a checkpoint/run dir."""
    resume_mismatch: str = "error"
    """What resuming does when the checkpoint's saved config differs from this one (another recipe, another
    profile, a changed value; run-control keys such as ``name`` never count): ``error`` refuses and lists the
    differing keys; ``allow`` continues under this config (e.g. to train a finished run for more epochs)."""
    stages: List[str] = field(default_factory=lambda: ["fit", "test"])
    """What ``recipes.fit`` runs, in order: ``fit``, ``validate``, ``test``."""
    test_ckpt: str = "best"
    """Checkpoint used by the stages after ``fit``: ``best`` or ``last``."""
    then: FollowUpConfig = field(default_factory=FollowUpConfig)
    """A follow-up recipe run by ``recipes.fit`` after this one (``then.recipe``)."""

    def __post_init__(self) -> None:
        problems = []
        if self.test_ckpt not in ("best", "last"):
            problems.append(f"test_ckpt={self.test_ckpt!r}: expected 'best' or 'last'")
        bad = [s for s in self.stages if s not in ("fit", "validate", "test")]
        if bad:
            problems.append(f"stages={self.stages}: unknown stage(s) {bad}; valid: fit, validate, test")
        if self.resume_mismatch not in ("error", "allow"):
            problems.append(f"resume_mismatch={self.resume_mismatch!r}: expected 'error' or 'allow'")
        if self.then.init_from not in ("best", "last", "none", "export"):
            problems.append(f"then.init_from={self.then.init_from!r}: expected 'best', 'last', 'none' or 'export'")
        if self.resume not in (None, "auto") and self.init_from is not None:
            problems.append("resume=<path> and init_from are mutually exclusive (resume restores everything)")
        if problems:
            raise ConfigError("; ".join(problems))


# ---------------------------------------------------------------------------------------------- results
@dataclass(frozen=True)
class Layer:
    """One source of configuration values: a label for messages and the values themselves."""

    label: str
    values: Any  # a mapping, or for the command line a list of "key=value" strings


@dataclass
class LoadedConfig:
    """The result of :func:`load_config`: the typed config, its merged tree and where each value came from."""

    run: RunConfig
    tree: DictConfig
    provenance: Dict[str, str]
    layers: List[str]
    overrides: List[str]
    sweep: Optional[Dict[str, Any]] = None
    """The recipe's ``sweep:`` block (not part of a run's config; ``recipes.sweep`` expands it)."""


# ---------------------------------------------------------------------------------------------- files
def recipe_path(name: str, cfg_dir: Path) -> Path:
    """Resolve a recipe name (or a path to a YAML file) to a file."""
    path = Path(name)
    if path.suffix in (".yaml", ".yml") and path.is_file():
        return path
    candidate = cfg_dir / "recipes" / f"{name}.yaml"
    if candidate.is_file():
        return candidate
    known = sorted(p.stem for p in (cfg_dir / "recipes").glob("*.yaml"))
    near = difflib.get_close_matches(name, known, n=3)
    hint = f"; did you mean {' or '.join(near)}?" if near else ""
    raise ConfigError(f"unknown recipe '{name}'{hint} Known recipes: {', '.join(known)}")


def _recipe_layers(name: str, cfg_dir: Path) -> Tuple[List[Layer], Optional[Dict[str, Any]]]:
    """The recipe's layers (its farthest ancestor first, through ``extends``) and its ``sweep:`` block (the
    nearest one along the chain)."""
    chain = recipe_chain(name, lambda n: recipe_path(n, cfg_dir))  # the recipe first, then its parent, ...
    for _, _, data in chain:
        data.pop("extends", None)
    sweeps = [data.pop("sweep") for _, _, data in chain if "sweep" in data]
    sweep = sweeps[0] if sweeps else None
    top = chain[0][1]
    chain[0][2].setdefault("recipe", top.stem)
    layers = [Layer(f"recipe {top.stem if i == 0 else n} ({path})", data)
              for i, (n, path, data) in reversed(list(enumerate(chain)))]
    if sweep is not None and not isinstance(sweep, dict):
        raise ConfigError(f"{top}: sweep must be a mapping (grid/zip/seeds/random/metric/mode), got {type(sweep).__name__}")
    return layers, sweep


def _profile_layer(name: str, cfg_dir: Path) -> Layer:
    path = Path(name)
    if not (path.suffix in (".yaml", ".yml") and path.is_file()):
        path = cfg_dir / "profiles" / f"{name}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in (cfg_dir / "profiles").glob("*.yaml"))
        near = difflib.get_close_matches(name, known, n=3)
        hint = f"; did you mean {' or '.join(near)}?" if near else ""
        raise ConfigError(f"unknown profile '{name}'{hint} Known profiles: {', '.join(known)}")
    return Layer(f"profile {path.stem} ({path})", read_yaml(path))


# ---------------------------------------------------------------------------------------------- merging
def _leaves(node: Any, prefix: str = "") -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    if isinstance(node, Mapping):
        if not node and prefix:
            out[prefix[:-1]] = {}
        for k, v in node.items():
            out.update(_leaves(v, f"{prefix}{k}."))
    else:
        out[prefix[:-1]] = node
    return out


def _merge_mapping(tree: DictConfig, values: Mapping, label: str) -> DictConfig:
    try:
        return OmegaConf.merge(tree, OmegaConf.create(dict(values)))
    except OmegaConfBaseException as err:
        raise friendly_error(err, label, RunConfig) from None
    except TypeError:  # "Cannot merge incompatible container types" (a mapping for a list, ...): find the key
        found = find_container_mismatch(tree, dict(values))
        if found is None:
            raise
        raise container_type_error(found[0], found[1], label, RunConfig) from None


def _apply_cli_item(tree: DictConfig, item: str) -> DictConfig:
    label = f"the command line '{item}'"
    if item.startswith("~"):
        key = item[1:]
        parent_key, _, leaf = key.rpartition(".")
        parent = OmegaConf.select(tree, parent_key) if parent_key else tree
        if parent is None or not isinstance(parent, DictConfig) or leaf not in parent:
            raise ConfigError(f"cannot delete '{key}' ({label}): no such entry")
        if parent_key and not _is_free_form(parent_key):
            raise ConfigError(f"cannot delete '{key}' ({label}): only entries of free-form mappings "
                              "(callbacks, method.args, data.args, trainer.extra) can be deleted")
        with open_dict(parent):
            del parent[leaf]
        return tree
    if "=" not in item:
        raise ConfigError(f"cannot parse {label}: expected key=value or ~key")
    key, _, raw = item.partition("=")
    if not key or key != key.strip():
        raise ConfigError(f"cannot parse {label}: expected key=value with no spaces around the key")
    try:
        parsed = OmegaConf.from_dotlist([item])
    except OmegaConfBaseException as err:
        raise ConfigError(f"cannot parse {label}: {str(err).splitlines()[0]}") from None
    try:
        return OmegaConf.merge(tree, parsed)
    except OmegaConfBaseException as err:
        if not getattr(err, "full_key", None):  # e.g. "Merge error: int is not a subclass of TrainerConfig"
            raise container_type_error(key, OmegaConf.to_container(parsed).get(key, raw) if "." not in key
                                       else OmegaConf.select(parsed, key), label, RunConfig) from None
        raise friendly_error(err, label, RunConfig) from None
    except TypeError:  # "Cannot merge incompatible container types": OmegaConf names no key
        found = find_container_mismatch(tree, OmegaConf.to_container(parsed))
        key, value = found if found is not None else (key, OmegaConf.select(parsed, key))
        raise container_type_error(key, value, label, RunConfig) from None


def _is_free_form(path: str) -> bool:
    head = path.split(".")
    return head[0] == "callbacks" or head[-1] in ("args", "extra") or "args" in head or "extra" in head


def _merge_layers(layers: Sequence[Layer]) -> Tuple[DictConfig, Dict[str, str]]:
    tree = OmegaConf.structured(RunConfig)
    provenance = {k: "schema" for k in _leaves(OmegaConf.to_container(tree))}
    for layer in layers:
        before = _leaves(OmegaConf.to_container(tree))
        if isinstance(layer.values, list):  # command-line items
            for item in layer.values:
                tree = _apply_cli_item(tree, item)
        else:
            tree = _merge_mapping(tree, layer.values, layer.label)
        after = _leaves(OmegaConf.to_container(tree))
        for k, v in after.items():
            if k not in before or before[k] != v:
                provenance[k] = layer.label
        for k in list(provenance):
            if k not in after:
                del provenance[k]
    return tree, provenance


def load_config(
    recipe: Optional[str] = None,
    overrides: Sequence[str] = (),
    profiles: Sequence[str] = (),
    config_files: Sequence[str] = (),
    cfg_dir: Optional[str] = None,
    validate_components: bool = True,
) -> LoadedConfig:
    """Build the run config from the layers (see the module docstring).

    Args:
        recipe: recipe name or YAML path; may be omitted when a ``--config`` file names a ``recipe``.
        overrides: command-line ``key=value`` / ``~key`` items.
        profiles: profile names (``configs/profiles/<name>.yaml``) or YAML paths, applied in order.
        config_files: extra YAML files, applied in order after the profiles.
        cfg_dir: the configs folder (default: see :func:`config_dir`).
        validate_components: check method/data/callback args against their registered config classes.

    Raises:
        ConfigError: with a one-line message naming the key, the layer and what would be valid.
    """
    root = config_dir(cfg_dir)
    for p in config_files:
        if not Path(p).is_file():
            raise ConfigError(f"--config {p}: no such file")
    file_layers = [Layer(f"--config {p}", read_yaml(Path(p))) for p in config_files]
    if recipe is None:
        named = [layer.values.get("recipe") for layer in file_layers if isinstance(layer.values, dict)]
        named = [n for n in named if n]
        if not named:
            raise ConfigError("no recipe given: pass --recipe NAME (see python -m recipes.ls)")
        recipe = named[-1]
    layers: List[Layer] = [Layer(f"defaults ({root / 'defaults.yaml'})", read_yaml(root / "defaults.yaml"))]
    recipe_layers, sweep = _recipe_layers(recipe, root)
    layers += recipe_layers
    recipe_end = len(layers)
    layers += [_profile_layer(p, root) for p in profiles]
    layers += file_layers
    cli = Layer("the command line", list(overrides))
    layers.append(cli)

    tree, provenance = _merge_layers(layers)
    if tree.smoke:
        tiny = registry.tiny_overrides(tree)
        if tiny:
            layers.insert(recipe_end, Layer("registry tiny overrides (smoke=true)", tiny))
            tree, provenance = _merge_layers(layers)

    try:
        OmegaConf.resolve(tree)
    except OmegaConfBaseException as err:
        raise friendly_error(err, "interpolation", RunConfig) from None
    missing = sorted(OmegaConf.missing_keys(tree))
    if missing:
        raise ConfigError(f"missing value(s) for {', '.join(missing)}: set them in the recipe or on the command line")
    try:
        check_list_elements(OmegaConf.to_container(tree, resolve=True), RunConfig)
    except ConfigError as err:
        raise ConfigError(_with_source(str(err), provenance)) from None
    try:
        run: RunConfig = OmegaConf.to_object(tree)
    except OmegaConfBaseException as err:
        raise friendly_error(err, "", RunConfig) from None
    except ValueError as err:  # a schema's own __post_init__ check
        raise ConfigError(_with_source(str(err), provenance)) from None
    if validate_components:
        _record_component_defaults(run, tree, provenance, registry.validate_run_components(run))
    return LoadedConfig(run=run, tree=tree, provenance=provenance, layers=[layer.label for layer in layers],
                        overrides=list(overrides), sweep=sweep)


def _with_source(message: str, provenance: Mapping[str, str]) -> str:
    """``message`` (``key=value: what is valid``) plus the layer that set the key, when one did."""
    key = message.split("=", 1)[0].split(":", 1)[0].strip()
    source = provenance.get(key)
    if not source or source == "schema" or "(from " in message:
        return message
    return f"{message} (from {source.split(' (')[0]})"


DEFAULT = "default"
"""The provenance of a component arg nobody set: the value of its config class's default (``recipes.show``)."""


def _record_component_defaults(run: RunConfig, tree: DictConfig, provenance: Dict[str, str],
                               completed: Mapping[str, Dict[str, Any]]) -> None:
    """Write each component's completed args (every field, defaults included) into ``run`` and ``tree``, so
    ``config.yaml`` and the fingerprint record them; the leaves no layer set get provenance :data:`DEFAULT`."""
    for where, values in completed.items():
        owner_key = where.rsplit(".", 1)[0]  # method, data, callbacks.<label>
        owner = run.callbacks[owner_key.split(".", 1)[1]] if owner_key.startswith("callbacks.") else getattr(run, owner_key)
        owner.args = dict(values)
        node = OmegaConf.select(tree, owner_key)
        with open_dict(node):
            node.args = dict(values)
        leaves = _leaves(values, where + ".")
        for leaf in leaves:
            provenance.setdefault(leaf, DEFAULT)
        for leaf in [k for k in provenance if k.startswith(where + ".") and k not in leaves]:
            del provenance[leaf]  # e.g. a mapping replaced by its completed leaves


def to_plain(run: RunConfig) -> Dict[str, Any]:
    """The config as plain containers (what checkpoints and ``config.yaml`` hold)."""
    return dataclasses.asdict(run)


def to_yaml(run: Union[RunConfig, Mapping[str, Any]], provenance: Optional[Mapping[str, str]] = None) -> str:
    """YAML text of a config; with ``provenance``, each leaf carries a ``# from <layer>`` comment (``# default``
    for a component arg no layer set: its config class's default)."""
    data = to_plain(run) if dataclasses.is_dataclass(run) else dict(run)
    if not provenance:
        return yaml.safe_dump(data, sort_keys=False, default_flow_style=False)
    # one line per scalar, so a comment after it cannot land inside a wrapped value
    text = yaml.safe_dump(data, sort_keys=False, default_flow_style=False, width=2**31 - 1)
    out, stack = [], []
    for line in text.splitlines():
        stripped = line.lstrip(" ")
        indent = (len(line) - len(stripped)) // 2
        if stripped.startswith("- ") or ":" not in stripped:
            out.append(line)
            continue
        key = stripped.split(":", 1)[0]
        del stack[indent:]
        stack.append(key)
        path = ".".join(stack)
        src = provenance.get(path)
        value_part = stripped.split(":", 1)[1].strip()
        if src == DEFAULT and value_part:
            out.append(f"{line}  # default")
        elif src and src != "schema" and value_part:
            out.append(f"{line}  # from {src.split(' (')[0]}")
        else:
            out.append(line)
    return "\n".join(out) + "\n"


def config_differences(saved: Mapping[str, Any], run: RunConfig) -> List[Tuple[str, Any, Any]]:
    """``(dotted key, saved value, current value)`` for every leaf where a saved config (a checkpoint's
    ``litctx.config``, a ``config.yaml``) differs from ``run``; run-control keys (``name``, ``run_dir``,
    ``resume``, ``runs_root``, ``resume_mismatch``) never count. A key missing on one side shows as
    :data:`ABSENT`. The same payload as the fingerprint, so ``resume=auto`` (which finds runs by fingerprint) and
    ``resume=<path>`` agree on what "the same config" means."""
    import json

    def plain(data: Mapping[str, Any]) -> Dict[str, Any]:
        data = {k: v for k, v in dict(data).items() if k not in _RUN_CONTROL_KEYS}
        return _leaves(json.loads(json.dumps(data, default=str)))  # schema order

    before, now = plain(saved), plain(fingerprint_payload(run))
    keys = list(now) + [k for k in before if k not in now]
    return [(k, before.get(k, ABSENT), now.get(k, ABSENT)) for k in keys if before.get(k, ABSENT) != now.get(k, ABSENT)]


ABSENT = "<absent>"
"""What :func:`config_differences` shows for a key one of the two configs lacks."""


def fingerprint_payload(run: RunConfig) -> Dict[str, Any]:
    """The part of the config that defines *what* is computed (no run-control keys)."""
    data = to_plain(run)
    for key in _RUN_CONTROL_KEYS:
        data.pop(key, None)
    return data
