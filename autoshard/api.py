"""``autoshard.estimate / recommend / tune``: the Python doors onto :mod:`autoshard.plan`.

They take the model as the user has it (a model object, real or on the meta device, a Hugging
Face model, a LightningModule, a factory, or a ``"path/to/file.py:build"`` target; see
:mod:`autoshard.target.adapters`) and the options of :class:`~autoshard.options.PlanOptions` (the
same as the command line's flags, validated in one place), and go through the one pipeline:
the same inputs give the same answer as ``autoshard estimate`` / ``export`` / ``tune``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from autoshard.config import RankOrder
from autoshard.decide import decide
from autoshard.errors import ConfigError
from autoshard.options import PlanOptions, TuneOptions, options_from, split_options
from autoshard.plan import Plan, make_plan, make_request
from autoshard.recommendation import Recommendation
from autoshard.results import MemoryEstimate

__all__ = [
    "Estimates", "estimate", "estimates_for", "recommend", "serve_study", "tune", "tune_with",
]  # fmt: skip


class Estimates(list[MemoryEstimate]):
    """The estimates of every candidate, in the order asked for, with the pipeline's decision
    for the same inputs (``recommendation``: what ``recommend()`` chooses; None when nothing
    fits, and then ``nothing_fits`` says so in one line, with what would fit) and the plan behind
    them (``plan.notes``: what was assumed). In a notebook (and with ``rich.print``) it renders as
    a table of the first 20, the recommended one marked.

    >>> import warnings
    >>> import autoshard
    >>> warnings.simplefilter("ignore", autoshard.PlanWarning)
    >>> estimates = autoshard.estimate("examples/gpt.py:build", kwargs={"size": "tiny"},
    ...                                gpus=8, gpu_memory="24GiB", seq_len=128)
    >>> estimates.recommendation.chosen.candidate == estimates[0].candidate
    True
    >>> page = estimates._repr_html_()  # a notebook's view: the recommended row marked
    >>> page.count('<tr class="recommended"'), "recommended" in page.split("</tr>")[1]
    (1, True)
    """

    def __init__(
        self,
        estimates: Iterable[MemoryEstimate],
        *,
        recommendation: Recommendation | None = None,
        plan: Plan | None = None,
        nothing_fits: str | None = None,
    ) -> None:
        super().__init__(estimates)
        self.recommendation = recommendation
        self.plan = plan
        self.nothing_fits = nothing_fits

    def __rich_console__(self, console: Any, options: Any) -> Any:
        from autoshard.ui.tables import ROWS, estimates_table

        hardware = self.plan.hardware if self.plan else None
        yield estimates_table(
            list(self), hardware, limit=ROWS, width=options.max_width, chosen=self._chosen()
        )

    def _repr_html_(self) -> str:
        from autoshard.ui.html import estimates_html

        hardware = self.plan.hardware if self.plan else None
        return estimates_html(list(self), hardware, chosen=self._chosen())

    def _chosen(self) -> Any:
        return self.recommendation.chosen.candidate if self.recommendation else None


def estimate(
    model: Any,
    *,
    kwargs: Mapping[str, Any] | None = None,
    batch: Any | None = None,
    sort: RankOrder | str = RankOrder.SPEED,
    **options: Any,
) -> Estimates:
    """Predict the per-GPU and host memory of every FSDP candidate for ``model``: the fitting
    ones first, the fastest predicted first (``sort="headroom"``: the most memory left first),
    then the rest by how far they overshoot.

    Takes the same model and options as :func:`recommend` (``gpus``, ``nodes``, ``gpu``,
    ``gpu_memory``, ``seq_len``, ``batch_size``, ``loop``, ``accumulate``, ``engine``,
    ``precision``, ``simulate``...: see :class:`~autoshard.options.PlanOptions`). The list's
    ``recommendation`` is what :func:`recommend` chooses for the same inputs.

    Example (runs on a CPU in a few seconds)::

        >>> import warnings
        >>> import autoshard
        >>> warnings.simplefilter("ignore", autoshard.NoGPUWarning)
        >>> estimates = autoshard.estimate("examples/gpt.py:build", kwargs={"size": "tiny"},
        ...                                gpus=8, gpu_memory="24GiB", seq_len=128)
        >>> fastest = estimates[0]
        >>> fastest.fits, fastest.candidate.cpu_offload  # offload is never the fastest
        (True, False)
        >>> estimates.recommendation.chosen.candidate == fastest.candidate
        True
    """
    return estimates_for(
        model, options_from(PlanOptions, options), kwargs=kwargs, batch=batch, sort=sort
    )


def estimates_for(
    model: Any,
    options: PlanOptions,
    *,
    kwargs: Mapping[str, Any] | None = None,
    batch: Any | None = None,
    sort: RankOrder | str = RankOrder.SPEED,
    flag: str = "sort=",
) -> Estimates:
    """:func:`estimate` with validated options (the command line's door)."""
    try:
        order = RankOrder(sort)
    except ValueError:
        choices = ", ".join(o.value for o in RankOrder)
        raise ConfigError(f"{flag} {sort}: choose one of {choices}") from None
    plan = make_plan(make_request(model, options, kwargs=kwargs, batch=batch))
    rec: Recommendation | None = None
    nothing_fits: str | None = None
    try:
        rec = decide(plan)
    except ConfigError as exc:  # nothing fits: the list says by how much, the line what would
        nothing_fits = str(exc)
    return Estimates(plan.ranked(order), recommendation=rec, plan=plan, nothing_fits=nothing_fits)


def recommend(
    model: Any,
    *,
    kwargs: Mapping[str, Any] | None = None,
    batch: Any | None = None,
    trials: int = 0,
    **options: Any,
) -> Recommendation:
    """Recommend the FSDP configuration for ``model``.

    Args:
        model: an ``nn.Module`` (real or meta), a Hugging Face model, a LightningModule, a
            factory (function or class) that returns a model or ``(model, batch)``, or a target
            string ``"path/to/file.py:build"``.
        kwargs: keyword arguments of the factory.
        batch: an example training batch (a dict is passed as keyword arguments, a tuple as
            positional ones; Hugging Face models get ``labels`` and return ``.loss``).
        trials: 0 decides from estimates alone (seconds); N > 0 runs up to N short real trials
            (:func:`tune`).
        options: what to plan for, as :class:`~autoshard.options.PlanOptions` (``gpus``,
            ``nodes``, ``gpu``, ``gpu_memory``, ``host_memory``, ``seq_len``, ``batch_size``,
            ``loop``, ``accumulate``, ``engine``, ``precision``, ``simulate``...) and, with
            trials, how to run them, as :class:`~autoshard.options.TuneOptions` (``out_dir``,
            ``trial_timeout``, ``warmup``, ``steps``, ``nproc``, ``storage``...).

    Returns:
        A :class:`Recommendation`: ``rec.chosen.candidate`` is the configuration,
        ``rec.reasons`` says why each setting, ``rec.runners_up`` / ``rec.ruled_out`` the rest.

    Example (runs on a CPU in a few seconds)::

        >>> import warnings
        >>> import torch
        >>> from torch import nn
        >>> from autoshard import NoGPUWarning, recommend
        >>> warnings.simplefilter("ignore", NoGPUWarning)
        >>> layers = [nn.TransformerEncoderLayer(256, 4, batch_first=True) for _ in range(4)]
        >>> rec = recommend(nn.Sequential(*layers), batch=torch.randn(2, 128, 256),
        ...                 gpus=8, gpu_memory="80GiB")
        >>> rec.profile.wrap_policy  # the repeated block: the unit of every per-block candidate
        ('torch.nn.modules.transformer.TransformerEncoderLayer',)
        >>> rec.chosen.estimate.fits, rec.chosen.estimate.speed.samples_per_s > 0
        (True, True)
    """
    if trials < 0:
        raise ConfigError(f"trials={trials}: give 0 (estimate only) or a number of trials")
    if trials > 0:
        return tune(model, kwargs=kwargs, batch=batch, trials=trials, **options)
    plan_values, tune_values = split_options(options)
    out_dir = tune_values.pop("out_dir", None)  # also where model objects are saved
    if tune_values:
        names = ", ".join(f"{k}=" for k in tune_values)
        raise ConfigError(f"{names} configure trials: give trials=N as well, or leave them out")
    opts = options_from(PlanOptions, plan_values)
    out = Path(out_dir) if out_dir is not None else None
    return decide(make_plan(make_request(model, opts, kwargs=kwargs, batch=batch, out_dir=out)))


def tune(
    model: Any,
    *,
    kwargs: Mapping[str, Any] | None = None,
    batch: Any | None = None,
    progress: bool = True,
    **options: Any,
) -> Recommendation:
    """Run (or resume) a study of short real FSDP trials and return the fastest configuration
    that fits. Takes what :func:`recommend` takes; ``trials`` defaults to 12.

    It shows its progress as ``autoshard tune`` does: a live table of the trials in a terminal
    or a notebook, one line per trial elsewhere; ``progress=False`` shows nothing.

    Real FSDP trials in a worker group (2 gloo CPU processes here; about 20 s):

    >>> import tempfile, warnings
    >>> import autoshard
    >>> warnings.simplefilter("ignore", autoshard.NoGPUWarning)
    >>> rec = autoshard.tune("examples/gpt.py:build", kwargs={"size": "tiny"}, seq_len=64,
    ...                      batch_size=1, gpu_memory="2GiB", trials=2, warmup=1, steps=2,
    ...                      out_dir=tempfile.mkdtemp(), progress=False)
    >>> rec.basis, rec.chosen.trial.status.value, rec.chosen.trial.world_size
    ('trials', 'ok', 2)
    """
    plan_values, tune_values = split_options(options)
    opts = options_from(PlanOptions, plan_values)
    tune_opts = options_from(TuneOptions, tune_values)
    if tune_opts.node_rank > 0:
        raise ConfigError(
            f"node_rank={tune_opts.node_rank}: the other nodes serve node 0's study; run "
            "`autoshard tune ... --node-rank N` there (autoshard.tune drives it on node 0)"
        )
    shown = _console() if progress else None
    return tune_with(model, opts, tune_opts, kwargs=kwargs, batch=batch, progress=shown)


def _console() -> Any:
    from rich.console import Console

    return Console()


def tune_with(
    model: Any,
    options: PlanOptions,
    tune_options: TuneOptions,
    *,
    kwargs: Mapping[str, Any] | None = None,
    batch: Any | None = None,
    progress: Any = None,
    cli: bool = False,
) -> Recommendation:
    """:func:`tune` with validated options (the command line's door, which adds only the
    printing): ``progress`` is the rich ``Console`` that shows the trials, or None."""
    from autoshard.search import run_study
    from autoshard.study.database import check_storage, prepare_out

    _check_nodes(options, tune_options, cli=cli)
    out_dir = Path(tune_options.out_dir)
    prepare_out(out_dir)  # a bad folder or storage is one error before the analysis
    if tune_options.storage:
        check_storage(tune_options.storage)
    request = make_request(model, options, kwargs=kwargs, batch=batch, out_dir=out_dir, trials=True)
    plan = make_plan(request)
    if progress is None:
        return run_study(plan, tune_options)
    from autoshard.ui.progress import StudyProgress

    theirs = tune_options.on_event
    with StudyProgress(progress, tune_options.trials, plan.hardware) as shown:

        def on_event(kind: Any, scored: Any) -> None:
            shown(kind, scored)
            if theirs is not None:
                theirs(kind, scored)

        return run_study(plan, tune_options.model_copy(update={"on_event": on_event}))


def serve_study(
    model: Any,
    options: PlanOptions,
    tune_options: TuneOptions,
    *,
    kwargs: Mapping[str, Any] | None = None,
) -> None:
    """A node other than node 0 of a study on several machines: its worker group serves the
    trials node 0 drives, until node 0 ends the study."""
    from autoshard.detect import detect_hardware
    from autoshard.target.adapters import to_target
    from autoshard.trials.group import WorkerGroup

    _check_nodes(options, tune_options, cli=True)
    out = Path(tune_options.out_dir)
    hardware = detect_hardware(options, trials=True)
    nproc = tune_options.nproc or hardware.gpus_per_node
    WorkerGroup(
        to_target(model, kwargs=kwargs, out_dir=out),
        tune_options.model_copy(update={"nproc": nproc}),
        log_dir=out / f"workers-node{tune_options.node_rank}",
        nnodes=options.nodes,
    ).serve()


def _check_nodes(options: PlanOptions, tune_options: TuneOptions, *, cli: bool) -> None:
    if options.nodes > 1 and not tune_options.rdzv_endpoint:
        if cli:
            raise ConfigError("--nodes > 1 needs --rdzv-endpoint host:port of node 0")
        raise ConfigError(f"nodes={options.nodes} needs rdzv_endpoint='host:port' of node 0")
