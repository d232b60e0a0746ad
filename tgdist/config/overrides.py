"""The command line's checks before Hydra starts: overrides read and checked against the typed
schema (one line naming the key, with the closest keys), sweeps expanded and every job validated,
``--help`` from the schema's comments. ``tgdist train``, ``tgdist partition`` and ``tgdist launch``
call these; the schema itself is ``tgdist.config``."""

from __future__ import annotations

import copy
import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra._internal.config_loader_impl import ConfigLoaderImpl
from omegaconf import DictConfig, OmegaConf, open_dict

import tgdist.config as schema
from tgdist.config import TrainApp, config_dir, key_notes

log = logging.getLogger(__name__)


def annotate(yaml_text: str, notes: dict[str, str], width: int = 100) -> str:
    """``yaml_text`` (``OmegaConf.to_yaml``) with each key's note: after the value when the line
    stays within ``width`` columns, else as comment lines above the key."""
    import textwrap

    out, path = [], []  # path: (indent, key) of the enclosing mappings
    for line in yaml_text.splitlines():
        m = re.match(r"( *)([\w.-]+):(.*)$", line)
        if not m:
            out.append(line)
            continue
        indent = len(m.group(1))
        while path and path[-1][0] >= indent:
            path.pop()
        key = ".".join([k for _, k in path] + [m.group(2)])
        path.append((indent, m.group(2)))
        note = notes.get(key)
        if note and len(line) + 4 + len(note) <= width:
            out.append(f"{line}  # {note}")
        elif note:
            pad = " " * indent
            out += textwrap.wrap(note, width, initial_indent=pad + "# ", subsequent_indent=pad + "# ")
            out.append(line)
        else:
            out.append(line)
    return "\n".join(out)


def print_help(command: str, config_name: str, overrides: list[str], source: ConfigSource | None = None) -> None:
    """``--help`` of a Hydra command: the ``hydra.help`` template of its config, where
    ``$CONFIG`` is the composed config (with ``overrides``) and each key's documentation."""
    from omegaconf import open_dict

    full = _compose_or_exit(command, config_name, overrides, return_hydra_config=True, source=source)
    if source is not None:  # a pkg:// primary is tgdist's own or a package's: no folder to list
        schema._help_roots = tuple(r for r in (source.primary, source.extra) if r and not r.startswith("pkg://"))
    try:
        template = str(full.hydra.help.template)
    finally:
        schema._help_roots = ()
    with open_dict(full):
        del full["hydra"]
    notes = key_notes(_schema_for(config_name))
    print(template.replace("$CONFIG", annotate(OmegaConf.to_yaml(full), notes) + "\n").rstrip())


@dataclass(frozen=True)
class ConfigSource:
    """Where a command's Hydra config is read from: its primary config ``name`` in the
    ``primary`` directory (tgdist's ``configs/`` unless ``--config-path`` names another), and a
    user's ``--config-dir``, searched after it (Hydra's order). The command's typed schema does
    not change with it: a user's config extends tgdist's (``defaults: [train, _self_]``)."""

    name: str
    primary: str
    extra: str | None = None
    job: str = "app"  # Hydra's job name (``hydra.job.name``): the stem of the command's file

    @classmethod
    def of(cls, args, config_name: str, app_file: str) -> ConfigSource:
        """The source Hydra's ``@hydra.main`` in ``app_file`` reads for these parsed flags
        (a relative ``--config-path`` is relative to that file, as Hydra has it)."""
        primary = config_dir()
        if args.config_path is not None:
            given = args.config_path
            primary = given if os.path.isabs(given) or given.startswith("pkg://") else \
                os.path.normpath(os.path.join(os.path.dirname(os.path.realpath(app_file)), given))
        extra = os.path.abspath(args.config_dir) if args.config_dir is not None else None
        return cls(args.config_name or config_name, primary, extra, Path(app_file).stem)


def precheck_overrides(command: str, config_name: str, argv: list[str], source: ConfigSource | None = None,
                       return_hydra_config: bool = False):
    """Compose once to turn a config error (a misspelt key, an unknown group option) into one line
    and exit code 2, instead of Hydra's multi-line report. Returns the composed config (None when
    ``argv`` holds flags, which are Hydra's to read); with ``return_hydra_config``, with Hydra's
    own settings under ``hydra`` (as Hydra composes a run: ``run_composed`` starts it)."""
    if any(a.startswith("-") for a in argv):
        return None
    return _compose_or_exit(command, config_name, argv, source=source, return_hydra_config=return_hydra_config)


def precheck_command(command: str, config_name: str, argv: list[str], validate: Callable[[Any], None],
                     app_file: str, return_hydra_config: bool = False):
    """What a Hydra command checks before Hydra starts. Parses the flags as Hydra would (a bad flag
    exits 2 with argparse's message), then checks the overrides against the config the flags name
    (``ConfigSource``; ``app_file`` holds the command's ``@hydra.main``): composed once for a run,
    or, with ``--multirun``, every job composed and passed to ``validate`` (see
    ``precheck_sweep``). Returns ``(args, cfg, sweep_dir)``: ``cfg`` is the composed config of a
    run (None for sweeps; with Hydra's settings under ``hydra`` given ``return_hydra_config``), and
    both are None for a rerun or shell completion, left to Hydra."""
    from hydra._internal.utils import get_args_parser

    if {"--version", "-V"} & set(argv):  # tgdist's, not Hydra's, wherever the flag stands
        from tgdist import version_line

        print(version_line())
        raise SystemExit(0)
    args = get_args_parser().parse_args(argv)
    if args.shell_completion:  # Hydra's script would complete a command named by its second word
        _exit_with(command, "shell completion (-sc) is not supported: Hydra's completion script completes a "
                            "program run without a subcommand, and tgdist's commands sit under one program")
    if args.experimental_rerun:
        return args, None, None
    logging_group = next((k for k in ("hydra/job_logging", "hydra/hydra_logging")
                          if override_value(args.overrides, k) is not None), None)
    if logging_group:  # configs/hydra/default.yaml sets these blocks itself, after the group's option
        key = logging_group.replace("/", ".")
        _exit_with(command, f"{logging_group}=...: tgdist sets {key} itself, so another option would be ignored; "
                            f"set its keys instead (e.g. {key}.root.level=WARNING)")
    if override_value(args.overrides, "hydra.mode") == "MULTIRUN" and not args.multirun:
        _exit_with(command, "hydra.mode=MULTIRUN: sweep with --multirun (-m), which checks every job before "
                            "the first starts")
    source = ConfigSource.of(args, config_name, app_file)
    if args.multirun and (args.cfg or args.info is not None or args.run):
        flag = "--cfg" if args.cfg else "--info" if args.info is not None else "--run"
        _exit_with(command, f"--multirun and {flag} do not go together: {flag} is for one run "
                            f"(give it one value of each swept key)")
    if args.help and not args.hydra_help:  # the keys with their documentation, not Hydra's bare listing
        overrides = sweep_jobs(command, config_name, args.overrides, None)[0][0] if args.multirun else args.overrides
        print_help(command, config_name, overrides, source)
        raise SystemExit(0)
    if args.multirun and not args.hydra_help:
        return args, None, precheck_sweep(command, config_name, args.overrides, validate, source)
    return args, precheck_overrides(command, config_name, args.overrides, source, return_hydra_config), None


@dataclass
class Sweep:
    """A ``--multirun`` checked before Hydra starts: its directory (resolved once; the default
    names the time, which Hydra would resolve again), its jobs (the overrides of each) and the
    keys it sweeps, which an error in a job names it by; the sweep's config as Hydra's sweeper
    reads it (``master``: composed for a multirun, the swept keys left to the jobs) and each
    job's config (``composed``, checked; both with Hydra's settings under ``hydra``), which
    ``run_sweep`` starts the sweep with, so that nothing is composed twice."""

    dir: str
    jobs: list[list[str]]
    swept: list[str]
    master: DictConfig | None = None
    composed: list[DictConfig] = field(default_factory=list)

    def set_dir(self, path: str) -> None:
        """The sweep's directory given as ``hydra.sweep.dir=PATH`` would give it: in the sweep's
        settings and each job's, and among their Hydra overrides (``multirun.yaml``,
        ``.hydra/hydra.yaml``)."""
        self.dir = path
        for cfg in (self.master, *self.composed):
            with open_dict(cfg.hydra):
                cfg.hydra.sweep.dir = path
                cfg.hydra.overrides.hydra.append(f"hydra.sweep.dir={quoted(path)}")


def precheck_sweep(command: str, config_name: str, overrides: list[str], validate: Callable[[Any], None],
                   source: ConfigSource | None = None) -> Sweep | None:
    """For ``--multirun``: compose and validate every job of the sweep (``sweep_jobs``) before Hydra
    makes the sweep directory, so a bad value fails in one line with exit 2 before any job runs,
    rather than in job N after the jobs before it. The jobs are those of Hydra's basic sweeper:
    the config's ``hydra.sweeper.params``, then the command line's overrides. None when a sweeper
    plugin (``hydra/sweeper=optuna``, once its config is found) is left to expand the sweep.
    The sweep's config and each job's are composed once, here (``Sweep``)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    try:
        OverridesParser.create().parse_overrides(overrides)
    except OverrideParseException as e:
        _exit_with(command, unreadable_override(e, config_name))
    if override_value(overrides, "hydra.mode") is None:
        overrides = [*overrides, "hydra.mode=MULTIRUN"]  # (as Hydra's own --multirun adds it)
    master = _compose_or_exit(command, config_name, overrides, return_hydra_config=True, source=source,
                              multirun=True)
    if not str(master.hydra.sweeper.get("_target_", "")).endswith(".BasicSweeper"):
        return None
    params = [f"{k}={v}" for k, v in (master.hydra.sweeper.get("params") or {}).items()]
    jobs, swept = _expand(command, config_name, params + list(overrides))
    if params:  # the sweep's own fixed values were not composed with the sweep's config
        _compose_shared(command, config_name, jobs, swept, source)
    composed = check_jobs(command, config_name, jobs, swept, validate, source, return_hydra_config=True)
    return Sweep(str(master.hydra.sweep.dir), jobs, swept, master, composed)


def sweep_jobs(command: str, config_name: str, overrides: list[str], validate: Callable[[Any], None] | None,
               source: ConfigSource | None = None) -> tuple[list[list[str]], list[str]]:
    """The jobs of a sweep as Hydra's basic sweeper expands it (lists ``a,b``, ``range(...)``,
    ``choice(...)``; one job per combination) and the swept keys. With ``validate``, every job is
    composed and validated first (``check_jobs``), after the values the jobs share."""
    jobs, swept = _expand(command, config_name, overrides)
    if validate is not None:
        _compose_shared(command, config_name, jobs, swept, source)
        check_jobs(command, config_name, jobs, swept, validate, source)
    return jobs, swept


def _compose_shared(command: str, config_name: str, jobs: list[list[str]], swept: list[str],
                    source: ConfigSource | None) -> None:
    """Compose the values every job shares (a job without its swept keys): an error in them is
    one line that names no job."""
    _compose_or_exit(command, config_name, [a for a in jobs[0] if a.partition("=")[0] not in swept], source=source)


def _expand(command: str, config_name: str, overrides: list[str]) -> tuple[list[list[str]], list[str]]:
    """The jobs of Hydra's basic sweeper for ``overrides`` and the swept keys; an override it
    cannot read or run is one line on stderr and exit code 2."""
    import sys

    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException, OverrideParseException

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except OverrideParseException as e:
        print(f"{command}: error: {unreadable_override(e, config_name)}", file=sys.stderr)
        sys.exit(2)
    try:
        jobs = BasicSweeper.split_arguments(parsed, None)[0]
    except HydraException as e:  # interval(a, b): a range to sample, which only a sweeper plugin does
        bad = next((o.input_line for o in parsed if o.is_sweep_override() and not o.is_discrete_sweep()), None)
        msg = (f"{bad}: Hydra's basic sweeper runs lists (a,b,c), range(...) and choice(...); interval(...) "
               f"needs a sweeper plugin (e.g. pip install hydra-optuna-sweeper, then hydra/sweeper=optuna)" if bad
               else str(e).strip().splitlines()[0])
        print(f"{command}: error: {msg}", file=sys.stderr)
        sys.exit(2)
    return jobs, [o.get_key_element() for o in parsed if o.is_sweep_override()]


def check_jobs(command: str, config_name: str, jobs: list[list[str]], swept: list[str],
               validate: Callable[[Any], None], source: ConfigSource | None = None,
               return_hydra_config: bool = False) -> list[DictConfig]:
    """Every job composed once and validated (``validate`` gets the config without Hydra's
    settings); the composed configs, in order. An error is one line on stderr and exit code 2,
    naming the job when the swept values cause it."""
    import sys

    from tgdist.errors import ConfigError, DataError

    composed, failed = [], []  # failed: (job number, swept values, message)
    for num, job in enumerate(jobs):
        where = swept_values(job, swept)
        cfg = _compose_or_exit(command, config_name, job, where=f"sweep job #{num}: {where}" if where else "",
                               return_hydra_config=return_hydra_config, source=source)
        composed.append(cfg)
        try:
            validate(without_hydra(cfg) if return_hydra_config else cfg)
        except (ConfigError, DataError) as e:
            failed.append((num, where, str(e)))
    if failed:
        num, where, msg = failed[0]
        if len(failed) < len(jobs) or len({m for _, _, m in failed}) > 1:  # the swept values cause it
            msg += f" (sweep job #{num}: {where})"
        print(f"{command}: error: {msg}", file=sys.stderr)
        sys.exit(2)
    return composed


def without_hydra(full: DictConfig) -> DictConfig:
    """A composed config without Hydra's settings: what a run trains with (as Hydra's ``run_job``
    gives its task a copy of the composed config less ``hydra``)."""
    cfg = copy.deepcopy(full)
    with open_dict(cfg):
        del cfg["hydra"]
    return cfg


def swept_values(job: list[str], swept: list[str]) -> str:
    """The overrides of ``job`` that the sweep varies, e.g. ``model=jodie parallel.i=2``."""
    return " ".join(a for a in job if a.partition("=")[0] in swept)


def override_value(overrides: list[str], key: str) -> str | None:
    """The value ``overrides`` give ``key`` (``key=V``, ``+key=V``, ``++key=V``, ``~key``), or None."""
    return next((a.partition("=")[2] for a in overrides if a.partition("=")[0].lstrip("+~") == key), None)


def quoted(value: str) -> str:
    """``value`` as a quoted Hydra override value (any path: spaces, brackets, commas)."""
    if "'" not in value:
        return f"'{value}'"
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def jobs_not_run(num: int, total: int) -> str:
    """``; the 2 jobs after it did not run`` for a sweep stopped by job ``num`` of ``total``
    (empty when it was the last)."""
    rest = total - num - 1
    return f"; the {rest} job{'s' * (rest != 1)} after it did not run" if rest > 0 else ""


def _compose_or_exit(command: str, config_name: str, overrides: list[str], where: str = "",
                     return_hydra_config: bool = False, source: ConfigSource | None = None,
                     multirun: bool = False):
    """The composed config; on a config error, one line on stderr (``where`` appended in
    parentheses) and exit code 2."""
    from tgdist.errors import ConfigError

    try:
        return checked_compose(overrides, config_name, return_hydra_config, source, multirun)
    except ConfigError as e:
        _exit_with(command, str(e) + (f" ({where})" if where else ""))


def _exit_with(command: str, message: str) -> None:
    """``COMMAND: error: MESSAGE`` on stderr and exit code 2 (bad input)."""
    import sys

    print(f"{command}: error: {message}", file=sys.stderr)
    sys.exit(2)


def checked_compose(overrides: list[str], config_name: str = "train", return_hydra_config: bool = False,
                    source: ConfigSource | None = None, multirun: bool = False):
    """Hydra's composed config (of ``source``, tgdist's own ``config_name`` by default), refusing
    what Hydra would accept silently (``+key`` not in the schema, a deleted key) and turning
    Hydra's errors, and interpolations that do not resolve, into one-line ``ConfigError``s that
    name the key. With ``multirun``, the config of a sweep as Hydra composes it for its sweeper
    (swept keys left at their defaults, the overrides listed under ``hydra.overrides``; Hydra's
    settings always included)."""
    from hydra import compose as hcompose
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from tgdist.errors import ConfigError

    overrides = with_run_config(list(overrides or []), config_name)  # a resume: the run's config.yaml first
    source = source or ConfigSource(config_name, config_dir())
    added = unknown_added_key(overrides, config_name, [r for r in (source.primary, source.extra) if r])
    if added:
        guesses = closest_keys(added, config_name)
        hint = f"; did you mean '{guesses[0]}'?" if guesses else ""
        raise ConfigError(f"+{added}: not a key of tgdist's config (a leading + adds a key, and the config has "
                          f"every key it reads){hint}")
    keys = set(schema_keys(_schema_for(config_name)))
    deleted = next((k for k in (o[1:].partition("=")[0] for o in overrides if o.startswith("~")) if k in keys), None)
    if deleted:
        raise ConfigError(f"~{deleted}: tgdist reads every key of its config, so none can be deleted; set a value "
                          f"instead")
    GlobalHydra.instance().clear()
    try:
        hydra = _start_hydra(source)
        if multirun:
            from hydra.types import RunMode

            cfg = hydra.compose_config(source.name, overrides, run_mode=RunMode.MULTIRUN, from_shell=False)
        else:
            cfg = hcompose(config_name=source.name, overrides=overrides, return_hydra_config=return_hydra_config)
    except (HydraException, OmegaConfBaseException, ValueError) as e:  # ValueError: model=null, say
        raise ConfigError(_hydra_error_line(e, config_name)) from None
    finally:
        GlobalHydra.instance().clear()
    unresolved = _unresolvable(cfg, config_name)
    if unresolved:
        raise ConfigError(unresolved)
    for key, (least, what) in counts_or_auto(_schema_for(config_name), cfg=cfg):  # the keys OmegaConf cannot type
        schema.parse_count_or_auto(OmegaConf.select(cfg, key), key, least, what)
    narrow(cfg)  # (after the values' checks: a bad value is named as such, whichever strategy reads it)
    return cfg


def narrow(cfg) -> None:
    """Give each strategy section of ``cfg`` (``memory``, ``pipeline``: ``tgdist.config.SECTIONS``)
    the config class of the strategy it names (``memory.backend``, ``pipeline.mode``), composed
    against the union of them all. A key of another strategy left at its default goes; one set
    to another value is a ``ConfigError`` naming the strategies that read it. A name with no
    registered class (``auto``, an unknown name, which the run's validation refuses) keeps the
    union. In place; ``cfg`` stays struct."""
    import dataclasses

    from tgdist.errors import ConfigError

    for group, (key, base) in schema.SECTIONS.items():
        if group not in cfg or not isinstance(cfg[group], DictConfig):
            continue
        section = cfg[group]
        name = str(section[key])
        target = schema.option_schema(group, name)
        composed = OmegaConf.get_type(section)
        if target is None or composed is target:
            continue
        defaults = {f.name: f.default for f in dataclasses.fields(composed)}
        reads = {f.name for f in dataclasses.fields(target)}
        kept = {}
        for k, value in OmegaConf.to_container(section, resolve=False, enum_to_str=True).items():
            if k in reads:
                kept[k] = value
            elif value != (str(defaults.get(k)) if isinstance(defaults.get(k), schema.Choice) else defaults.get(k)):
                by = schema.readers(group, k)
                by = list(dict.fromkeys(n for n in by if schema.option_schema(group, n) is not None))
                who = " or ".join(f"{group}.{key}={n}" for n in _distinct(group, by)) or "no registered strategy"
                raise ConfigError(f"{group}.{k}={value} is read by {who} only; {group}.{key}={name} does not read it")
        typed = OmegaConf.merge(OmegaConf.structured(target), kept)
        OmegaConf.set_struct(typed, True)
        cfg[group] = typed


def _distinct(group: str, names: list[str]) -> list[str]:
    """``names`` with one name per config class (an alias, ``none`` for ``plain``, says nothing more)."""
    seen, out = set(), []
    for n in names:
        cls = schema.option_schema(group, n)
        if cls not in seen:
            seen.add(cls)
            out.append(n)
    return out


def counts_or_auto(root: type, prefix: str = "", cfg=None) -> list[tuple[str, tuple[int, str]]]:
    """The count-or-auto keys of a schema dataclass (``config.count_or_auto``) with their rules; with
    a composed ``cfg``, each section as the class it was composed to (a strategy's own keys)."""
    import dataclasses

    found = []
    for f in dataclasses.fields(root):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            sub = cfg.get(f.name) if isinstance(cfg, DictConfig) else None
            kind = OmegaConf.get_type(sub) if isinstance(sub, DictConfig) else _composed_type(type(default))
            found += counts_or_auto(kind, f"{prefix}{f.name}.", sub)
        elif "count_or_auto" in f.metadata:
            found.append((prefix + f.name, f.metadata["count_or_auto"]))
    return found


def _composed_type(cls: type) -> type:
    """A section's base class as Hydra composes it (the union of its strategies' classes)."""
    group = next((g for g, (_, base) in schema.SECTIONS.items() if cls is base), None)
    return schema.section_schema(group) if group else cls


def _search_path(source: ConfigSource):
    """The search path ``@hydra.main`` builds from ``--config-path`` and ``--config-dir``."""
    from hydra._internal.utils import create_config_search_path
    from hydra.core.config_search_path import SearchPathQuery

    from tgdist.errors import ConfigError

    search_path = create_config_search_path(source.primary)
    if source.extra is not None:
        if not os.path.isdir(source.extra):
            raise ConfigError(f"--config-dir {source.extra}: no such directory")
        search_path.prepend(provider="command-line", path=f"file://{source.extra}",
                            anchor=SearchPathQuery(provider="schema"))
    return search_path


def _start_hydra(source: ConfigSource):
    """Hydra's global state for ``source`` (its search path, its job name); returns the ``Hydra``."""
    from hydra._internal.hydra import Hydra

    return Hydra.create_main_hydra2(task_name=source.job, config_search_path=_search_path(source))


def run_composed(full, task: Callable[[Any], Any], source: ConfigSource) -> None:
    """Start a run as Hydra's ``@hydra.main`` starts one (its logging, its run directory and
    ``.hydra/`` files, ``hydra.job.chdir``, its callbacks; ``hydra.core.utils.run_job``, the
    function Hydra's own launchers call), with ``full``: the run's config, composed once before
    (``precheck_command``), with Hydra's settings under ``hydra``. ``task`` gets the config
    without them, as ``@hydra.main``'s function does; an exception it raises is raised here."""
    from hydra._internal.callbacks import Callbacks
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra.core.utils import configure_log, run_job
    from hydra.types import HydraContext, RunMode

    with open_dict(full.hydra):
        full.hydra.mode = RunMode.RUN
    configure_log(full.hydra.hydra_logging, full.hydra.verbose)  # (Hydra's own lines, as its run)
    callbacks = Callbacks(full)
    callbacks.on_run_start(config=full, config_name=source.name)
    loader = ConfigLoaderImpl(config_search_path=_search_path(source))
    ret = run_job(hydra_context=HydraContext(config_loader=loader, callbacks=callbacks), task_function=task,
                  config=full, job_dir_key="hydra.run.dir", job_subdir_key=None, configure_logging=True)
    callbacks.on_run_end(config=full, config_name=source.name, job_return=ret)
    _ = ret.return_value  # raises the task's exception


def run_sweep(sweep: Sweep, task: Callable[[Any], Any], source: ConfigSource) -> None:
    """Start a checked ``--multirun`` as ``@hydra.main`` starts one (its logging and callbacks,
    Hydra's sweeper and launcher: ``hydra.sweeper``, ``hydra/launcher=...``, ``multirun.yaml``
    and each job's folder and ``.hydra/`` files), with the sweep's config and each job's as
    composed and checked before (``precheck_sweep``): a launcher asking for a job's config gets
    that one (``_ComposedJobs``), so each is composed once. ``task`` gets a job's config
    without Hydra's settings; an exception it raises is raised here."""
    from hydra._internal.callbacks import Callbacks
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.plugins import Plugins
    from hydra.core.utils import configure_log
    from hydra.types import HydraContext

    master = sweep.master
    GlobalHydra.instance().clear()
    try:
        _start_hydra(source)  # (Hydra's global state, which its launchers carry to their jobs)
        configure_log(master.hydra.hydra_logging, master.hydra.verbose)
        callbacks = Callbacks(master)
        callbacks.on_multirun_start(config=master, config_name=source.name)
        jobs = {_task_overrides(job): cfg for job, cfg in zip(sweep.jobs, sweep.composed)}
        loader = _ComposedJobs(_search_path(source), jobs)
        sweeper = Plugins.instance().instantiate_sweeper(
            config=master, hydra_context=HydraContext(config_loader=loader, callbacks=callbacks), task_function=task)
        sweeper.sweep(arguments=OmegaConf.to_container(master.hydra.overrides.task, resolve=False))
        callbacks.on_multirun_end(config=master, config_name=source.name)
    finally:
        GlobalHydra.instance().clear()


def _task_overrides(job: list[str]) -> tuple[str, ...]:
    """The overrides of a job as Hydra's sweeper hands them to its launcher: Hydra's own
    (``hydra.*``, ``hydra/...=``) are the sweep's, not the job's."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return tuple(o.input_line for o in OverridesParser.create().parse_overrides(job) if not o.is_hydra_override())


class _ComposedJobs(ConfigLoaderImpl):
    """Hydra's config loader for a sweep whose jobs were composed (and checked) before it
    started: the launcher's request for a job's config (``load_sweep_config``, also in a job's
    own process under a launcher such as submitit's, which carries the loader there) returns that
    config, with the sweep's values that Hydra copies into each job (``OmegaConf.copy_cache``:
    the resolved time of the sweep's folder name). A job it was not given (a sweeper plugin's)
    is composed as Hydra composes it."""

    def __init__(self, config_search_path, jobs: dict[tuple[str, ...], DictConfig]):
        super().__init__(config_search_path=config_search_path)
        self.jobs = jobs

    def load_sweep_config(self, master_config: DictConfig, sweep_overrides: list[str]) -> DictConfig:
        job = self.jobs.get(tuple(sweep_overrides))
        if job is None:
            return super().load_sweep_config(master_config, sweep_overrides)
        job = copy.deepcopy(job)  # (the launcher sets the job's number and folder on it)
        OmegaConf.copy_cache(from_config=master_config, to_config=job)
        return job


def _unresolvable(cfg, config_name: str = "train") -> str | None:
    """One line for the first value of ``cfg`` (Hydra's own settings aside) whose interpolation
    does not resolve (``${oc.env:UNSET}``, a missing key) or resolves to a value of the wrong type,
    else None. ``${hydra:...}`` resolves only inside a run and is left to it."""
    from omegaconf import DictConfig, ListConfig
    from omegaconf.errors import OmegaConfBaseException

    def first_error(node, prefix: str) -> str | None:
        for key in (range(len(node)) if isinstance(node, ListConfig) else node.keys()):
            path = f"{prefix}[{key}]" if isinstance(node, ListConfig) else f"{prefix}{key}"
            if path == "hydra":
                continue
            try:
                value = node[key]
            except OmegaConfBaseException as e:
                choice = choice_error(str(e), config_name)
                if choice:  # ${oc.env:X} giving a value that is not an option
                    return choice
                line = str(e).strip().splitlines()[0]
                if "HydraConfig was not set" in line:
                    continue
                return f"{path}: cannot resolve its value: {re.sub(r'^[A-Za-z]+ raised while resolving interpolation: ', '', line)}"
            if isinstance(value, (DictConfig, ListConfig)):
                found = first_error(value, path if isinstance(value, ListConfig) else path + ".")
                if found:
                    return found
        return None

    return first_error(cfg, "")


def _hydra_error_line(e: Exception, config_name: str) -> str:
    """One line for a Hydra composition error: its first line and cause, the options of a group,
    a quoting hint for a value Hydra could not parse, the key a typo most likely meant."""
    if getattr(e, "override", None) is not None:  # OverrideParseException: it names the override it could not read
        return unreadable_override(e, config_name)
    lines = str(e).strip().splitlines()
    first = lines[0].rstrip(".")
    in_file = re.match(r"In '([^']+)': \w+ raised while composing config:?$", first)
    choice = choice_error(f"{e}\n{e.__cause__ or ''}", config_name)
    if choice:
        return f"config file {in_file.group(1)}.yaml: {choice}" if in_file else choice
    if in_file and len(lines) > 1:  # a key or value of a config file: the file, the key and what is wrong
        key = next((ln.split(":", 1)[1].strip() for ln in lines if ln.strip().startswith("full_key:")), "")
        msg = f"config file {in_file.group(1)}.yaml: " + (f"{key}: " if key else "") + lines[1].strip().rstrip(".")
        guesses = closest_keys(key, config_name) if key and " not in " in lines[1] else []
        return msg + (f"; did you mean '{guesses[0]}'?" if guesses else "")
    cause = str(e.__cause__).strip().splitlines()[0] if e.__cause__ is not None else ""
    options, listing = [], False
    for ln in str(e).splitlines():  # the indented lines right after "Available options"
        if ln.startswith("Available options"):
            listing = True
        elif listing and ln.startswith(("    ", "\t")):
            options.append(ln.strip())
        elif listing:
            break
    shown = ", ".join(o for o in options if not o.endswith("_schema"))
    msg = first + (f": {cause}" if cause else "") + (f" (options: {shown})" if shown else "")
    if first.startswith("Ambiguous value for argument"):  # a comma in a value, e.g. data.columns
        key, _, value = first.split("'")[1].partition("=")
        msg += f": quote a value with commas, \"{key}='{value}'\", or add --multirun to sweep over it"
    typo = re.match(r"Could not override '([^']+)': Key '[^']+' not in '(\w+)'$", msg)
    if typo and (other := _other_strategys_key(typo.group(1).lstrip("+~"), typo.group(2))):
        return other
    guesses = [f"'{k}'" for k in closest_keys(typo.group(1), config_name)] if typo else []
    if guesses:
        said = guesses[0] if len(guesses) == 1 else ", ".join(guesses[:-1]) + " or " + guesses[-1]
        msg += f"; did you mean {said}?"
    elif typo and (siblings := keys_under(typo.group(1).lstrip("+~").rpartition(".")[0], config_name)):
        msg += f"; its keys are {', '.join(siblings)}"
    return msg


def _other_strategys_key(key: str, composed: str) -> str | None:
    """The line for a key of another strategy given on top of a preset that names one strategy
    (``memory=daemon memory.remote_dispatch=...``: the preset composes the daemon's config class,
    which has no such key), or None when ``key`` is no strategy's key."""
    import dataclasses

    group, _, name = key.partition(".")
    if group not in schema.SECTIONS:
        return None
    by = _distinct(group, [n for n in schema.readers(group, name) if schema.option_schema(group, n) is not None])
    if not by:
        return None
    field = schema.SECTIONS[group][0]
    preset = [n for n in schema.option_names(group) if getattr(schema.option_schema(group, n), "__name__", "") == composed]
    if not preset or name in {f.name for f in dataclasses.fields(schema.option_schema(group, preset[0]))}:
        return None
    return (f"{key} is read by {' or '.join(f'{group}.{field}={n}' for n in by)} only, and the {group} preset given has "
            f"the keys of {group}.{field}={'|'.join(preset)} alone")


def choice_error(text: str, config_name: str) -> str | None:
    """``model.name=gat: choose one of tgn, jodie, apan`` when ``text`` (OmegaConf's report,
    with its ``full_key:`` line) refuses the value of a ``Choice`` key of the schema, else None."""
    key = re.search(r"full_key: (\S+)", text)
    options = choice_of(key.group(1), config_name) if key else None
    if options is None:
        return None
    value = (re.search(r"Invalid value '(.*)', expected one of", text) or re.search(r"Value (.*) \(\w+\) is not a "
             r"valid input", text) or re.search(r"Error merging override [^=\s]+=(.*)", text))
    shown = value.group(1) if value else "null" if "is not Optional" in text else None
    return f"{key.group(1)}={shown}: choose one of {', '.join(options.__members__)}" if shown is not None else None


def choice_of(key: str, config_name: str) -> type[schema.Choice] | None:
    """The ``Choice`` type of ``key`` (``model.name`` -> ``ModelName``) in the command's
    schema, or None for a key of another type (or not in the schema)."""
    import dataclasses
    import typing

    node: Any = _schema_for(config_name)
    for part in key.split("."):
        if not dataclasses.is_dataclass(node):
            return None
        node = typing.get_type_hints(_composed_type(node)).get(part)
    return node if isinstance(node, type) and issubclass(node, schema.Choice) else None


def unreadable_override(e: Exception, config_name: str) -> str:
    """One line for Hydra's ``OverrideParseException``, about the override it names (the first
    one it could not read: another that holds quotes or non-ASCII letters, correctly quoted, is
    not at fault): a key outside Hydra's key syntax (a non-ASCII letter) with the key most likely
    meant; a value that needs quotes with its quoted form; else Hydra's first line."""
    override = e.override
    key, eq, value = override.partition("=")
    name = key.lstrip("+~")
    if not re.fullmatch(r"[\w$./@-]+", name, re.ASCII):  # Hydra's keys: ASCII names joined by . / @
        guesses = closest_keys(name, config_name)
        return (f"cannot read the override {override!r}: {name!r} is not a key of tgdist's config"
                + (f"; did you mean '{guesses[0]}'?" if guesses else ""))
    if eq and "'" not in value and not value.startswith('"') and re.search(r"[=~\s\"()<>;&|]|[^\x00-\x7f]", value):
        return (f"cannot read the override {override!r}: Hydra reads = ~ spaces, quotes and non-ASCII letters in "
                f"a value only inside quotes: \"{key}='{value}'\"")
    if not eq and not override.startswith(("+", "~")):  # a word of a value the shell split at a space
        return (f"cannot read the override {override!r}: an override is KEY=VALUE; if it is the rest of a value "
                f"with spaces that the shell split, quote the whole override, e.g. \"data.path='/my data/x.csv'\"")
    first = str(e).strip().splitlines()[0].rstrip(".")
    return first if override in first else f"cannot read the override {override!r}: {first}"


def unknown_added_key(overrides: list[str], config_name: str, roots: list[str] | None = None) -> str | None:
    """The key of the first ``+key=value`` (or ``++``) override that is not in the schema: Hydra
    adds it silently, so ``+train.epoch=1`` would train the default epochs without a word, and
    ``+epochs=1`` too unless ``epochs`` is a config group (a folder of ``roots``, the config
    directories searched: tgdist's ``configs/`` by default, and a user's). Keys under a free-form
    (non-group) key and Hydra's own are left alone."""
    keys = set(schema_keys(_schema_for(config_name)))
    groups = {k.rpartition(".")[0] for k in keys}
    folders = [Path(r) for r in (roots or [config_dir()]) if not str(r).startswith("pkg://")]
    for override in overrides:
        if not override.startswith("+") or "=" not in override:
            continue
        key = override.lstrip("+").partition("=")[0].strip()
        if key.startswith("hydra.") or key in keys:
            continue  # hydra.* is Hydra's
        if "." not in key and (key.startswith("hydra") or any((r / key).is_dir() for r in folders)):
            continue  # +group=option selects a config of a group
        parts = key.split(".")
        if any(".".join(parts[:i]) in keys and ".".join(parts[:i]) not in groups for i in range(1, len(parts))):
            continue  # inside a key that holds a free-form value
        return key
    return None


def schema_keys(root: type, prefix: str = "") -> list[str]:
    """Every key path of a schema dataclass, groups included: ``train``, ``train.epochs``, ..."""
    import dataclasses

    keys = []
    for f in dataclasses.fields(root):
        path = prefix + f.name
        keys.append(path)
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):  # a strategy section: the keys of every registered strategy
            keys += schema_keys(_composed_type(type(default)), path + ".")
    return keys


def _schema_for(config_name: str) -> type:
    from tgdist.config import PartitionJob

    return PartitionJob if config_name.startswith("partition") else TrainApp


def keys_under(parent: str, config_name: str) -> list[str]:
    """The last parts of the keys directly under ``parent`` (``sampler`` -> ``strategy``,
    ``fanouts``, ...), in schema order; empty when ``parent`` is not a group of the schema."""
    return [k.rpartition(".")[2] for k in schema_keys(_schema_for(config_name)) if k.rpartition(".")[0] == parent] \
        if parent else []


def closest_keys(key: str, config_name: str) -> list[str]:
    """The keys a misspelt override most likely meant: under an existing parent, a close spelling
    of the last part (``train.epoch``); else the keys whose last part it is (``epochs``,
    ``trian.epochs`` -> ``train.epochs``); else a close spelling of the whole path (``modle``)."""
    import difflib

    keys = schema_keys(_schema_for(config_name))
    name = key.lstrip("+~")
    parent, _, last = name.rpartition(".")
    if parent in keys:
        siblings = [k.rpartition(".")[2] for k in keys if k.rpartition(".")[0] == parent]
        return [f"{parent}.{k}" for k in difflib.get_close_matches(last, siblings, n=1, cutoff=0.6)]
    same_leaf = [k for k in keys if k.rpartition(".")[2] == last]
    return same_leaf or difflib.get_close_matches(name, keys, n=1, cutoff=0.75)



# What a resumed run never takes from its run's config.yaml: where it writes, the resume itself, and
# train.stop_after_batches, which stops one command (a resume would stop again at once).
_NOT_RESUMED = frozenset({"run_dir", "train.resume", "train.overwrite", "train.stop_after_batches"})


def resume_path(overrides: list[str]) -> Path | None:
    """The path ``train.resume=`` gives in ``overrides`` (Hydra's quotes taken off, ``~``
    expanded, relative to the working directory), or None."""
    value = override_value(overrides, "train.resume")
    if value is None or value.strip() in ("", "null", "None"):
        return None
    value = value.strip()
    if len(value) > 1 and value[0] == value[-1] and value[0] in "'\"":
        value = value[1:-1].replace('\\"', '"').replace("\\\\", "\\")
    return Path(value).expanduser().absolute()


def resumed_run_dir(resume: str | Path | None) -> Path | None:
    """The run directory ``train.resume`` names: RUN_DIR itself, or the run holding
    ``RUN_DIR/checkpoints/FILE.pt``; None for a checkpoint file elsewhere (or no resume)."""
    if not resume:
        return None
    p = Path(resume).expanduser().absolute()
    if p.is_dir():
        return p
    return p.parent.parent if p.parent.name == "checkpoints" else None


def saved_config(resume: str | Path | None) -> tuple[Path, Any] | None:
    """``(path, config)`` of the ``config.yaml`` of the run ``train.resume`` names, or None when the
    checkpoint is not in a run directory that has one (a file copied elsewhere)."""
    from tgdist.errors import ConfigError, first_line

    run = resumed_run_dir(resume)
    if run is None or not (run / "config.yaml").is_file():
        return None
    path = run / "config.yaml"
    try:
        saved = OmegaConf.load(path)
    except Exception as e:  # noqa: BLE001 - YAML's and OmegaConf's errors alike: one line
        raise ConfigError(f"train.resume={resume}: cannot read the run's {path} ({first_line(e)}); repair it, "
                          f"or resume from checkpoints/last.pt with every setting given") from None
    if not isinstance(saved, DictConfig):
        raise ConfigError(f"train.resume={resume}: {path} is not a tgdist config (a mapping of settings)")
    return path, saved


def leaf_keys(config_name: str = "train") -> list[str]:
    """The schema's keys that hold values (``train.epochs``; not the groups ``train``)."""
    keys = schema_keys(_schema_for(config_name))
    parents = {k.rpartition(".")[0] for k in keys}
    return [k for k in keys if k not in parents]


def override_text(value) -> str:
    """A plain value (config.yaml's) as a Hydra override value that reads back as the same value."""
    import math

    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf") if math.isinf(value) else repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(override_text(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{override_text(v)}" for k, v in value.items()) + "}"
    return quoted(str(value))


def config_groups() -> list[str]:
    """The config groups a ``NAME=OPTION`` override chooses from (``configs/``' folders)."""
    return sorted(p.name for p in Path(config_dir()).iterdir() if p.is_dir() and p.name != "hydra")


def _group_mismatch(saved, group: str, option: str, given: frozenset = frozenset()) -> str | None:
    """None when ``saved`` (a run's config) holds every setting the file of ``group=option`` sets
    but the keys ``given`` on the same command line (its own keys; the groups an experiment
    chooses are not followed); else the first that differs, as ``KEY=FILE'S (the run has RUN'S)``."""
    path = Path(config_dir()) / group / f"{option}.yaml"
    try:
        text = path.read_text()
        values = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    except Exception:  # noqa: BLE001 - no such option, or a value that resolves only in Hydra: not known to match
        return f"{group}={option} (its settings could not be read to compare)"
    if not isinstance(values, dict):
        return f"{group}={option} (not a mapping of settings)"
    prefix = "" if "@package _global_" in text else f"{group}."
    flat: dict = {}

    def walk(d: dict, at: str) -> None:
        for k, v in d.items():
            if isinstance(v, dict):
                walk(v, f"{at}{k}.")
            else:
                flat[f"{at}{k}"] = v

    walk({k: v for k, v in values.items() if k != "defaults"}, prefix)
    missing = object()
    for key, value in flat.items():
        if key in given:
            continue
        have = OmegaConf.select(saved, key, default=missing, throw_on_missing=False)
        have = OmegaConf.to_container(have, resolve=True) if OmegaConf.is_config(have) else have
        if have is missing or have != value:
            return f"{key}={override_text(value)} (the run has {'nothing' if have is missing else override_text(have)})"
    return None


def with_run_config(overrides: list[str], config_name: str = "train") -> list[str]:
    """``overrides`` as a resume runs them: when they resume a run (``train.resume=RUN``) that
    holds a ``config.yaml``, every setting of that file comes first, as ``key=value`` overrides,
    and the given ones follow, so they apply on top; what may change on a resume is checked
    against the checkpoint afterwards (``runtime.checkpoint.check_resume``), before any data is
    read. Unchanged otherwise (no resume, or a checkpoint outside a run directory).

    A group choice (``model=jodie``) given with a resume is kept out when the run has its settings
    (those the same command does not give as keys), and refused otherwise: the group's file would
    replace the run's settings wholesale, and which of them a resume may change is a per-key
    question."""
    from tgdist.errors import ConfigError

    if {"-m", "--multirun"} & set(overrides):
        return list(overrides)
    resume = resume_path([o for o in overrides if not o.startswith("-")])
    found = saved_config(resume)
    if found is None:
        return list(overrides)
    path, saved = found
    groups = config_groups()
    given = frozenset(o.partition("=")[0].lstrip("+") for o in overrides if "=" in o and not o.startswith("-"))
    kept = []
    for o in overrides:
        key, eq, value = o.partition("=")
        key = key.lstrip("+")
        if eq and not o.startswith("-") and key in groups:
            option = value.strip("'\"")
            # a choice whose settings the run has (an earlier command pasted back) adds nothing: kept out.
            # (Not Hydra's record of the run's choices: a resumed run's names the default groups.)
            if (differs := _group_mismatch(saved, key, option, given)) is None:
                continue
            raise ConfigError(f"{key}={value}: a resume keeps the run's config groups ({key}={option} sets {differs}); "
                              f"drop {key}={value}, and give single keys ({key}.KEY=VALUE) for what a resume may "
                              f"change")
        kept.append(o)
    saved_keys = []
    for key in leaf_keys(config_name):
        if key in _NOT_RESUMED:
            continue
        value = OmegaConf.select(saved, key, default="__missing__", throw_on_missing=False)
        if isinstance(value, str) and value == "__missing__":  # a key added since the run was written
            continue
        if OmegaConf.is_config(value):
            value = OmegaConf.to_container(value, resolve=True)
        saved_keys.append(f"{key}={override_text(value)}")
    at = next((i for i, o in enumerate(kept) if "=" in o and not o.startswith("-")), len(kept))
    return kept[:at] + saved_keys + kept[at:]


def resume_note(cfg, config_name: str = "train") -> str | None:
    """What a resumed run took from where, for its log: the run's ``config.yaml`` and the keys
    this command changed (``train.epochs 4 -> 6``); None when ``cfg`` resumes nothing."""
    resume = OmegaConf.select(cfg, "train.resume")
    if not resume:
        return None
    found = saved_config(resume)
    if found is None:
        return (f"resuming from {resume}, which is not in a run directory with a config.yaml: the settings are this "
                f"command's (defaults and overrides), checked against the checkpoint")
    path, saved = found
    changed = []
    for key in leaf_keys(config_name):
        if key in _NOT_RESUMED:
            continue
        was = OmegaConf.select(saved, key, default=None, throw_on_missing=False)
        now = OmegaConf.select(cfg, key, default=None, throw_on_missing=False)
        was, now = (OmegaConf.to_container(v, resolve=True) if OmegaConf.is_config(v) else v for v in (was, now))
        if was != now:
            changed.append(f"{key} {override_text(was)} -> {override_text(now)}")
    return (f"resuming with the settings of {path}; " +
            (f"changed by this command: {', '.join(changed)}" if changed else "none changed by this command"))
