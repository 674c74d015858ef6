"""autoshard's exceptions, and the warnings that say what it assumed.

Every error a user can cause is an :class:`AutoshardError` subclass whose message is one line
that says what is wrong and how to fix it. The CLI prints that line and exits 1; tracebacks are
shown only with ``--debug``.
"""

from __future__ import annotations


class AutoshardError(Exception):
    """Root of every user-facing autoshard error: its message is one line that says what is wrong
    and how to fix it (the command line prints it and exits 1).

    >>> from autoshard import AutoshardError, TargetSpec, analyze_target
    >>> try:
    ...     analyze_target(TargetSpec(spec="no/such/model.py:build"))
    ... except AutoshardError as error:
    ...     print(error)
    model file not found: no/such/model.py
    """


class TargetError(AutoshardError):
    """The model target (``file.py:callable`` or ``package.module:callable``) cannot be used."""


class ModelError(AutoshardError):
    """The model was built but cannot be analysed (no parameters, not a module, ...)."""


class ConfigError(AutoshardError):
    """A flag or argument has a value autoshard cannot use (bad size, bad precision, ...)."""


class ResultError(AutoshardError):
    """A result file or directory (from ``tune`` or ``estimate``) is missing or unreadable."""


class MissingDependencyError(AutoshardError):
    """An optional dependency is needed for this feature and is not installed."""

    def __init__(
        self, package: str, feature: str, extra: str | None = None, install: str | None = None
    ) -> None:
        install = install or (
            f"`pip install 'autoshard[{extra}]'`" if extra else f"`pip install {package}`"
        )
        super().__init__(f"{feature} needs {package}, which is not installed: run {install}")
        self.package = package


class StorageError(AutoshardError):
    """The study's storage or output folder cannot be used: not writable, a file where a folder
    should be, a database that cannot be opened or written, a full disk, a bad ``--storage``."""


class StudyLockedError(StorageError):
    """Another ``autoshard tune`` is running on the same output folder."""

    def __init__(self, message: str, pid: int | None = None) -> None:
        super().__init__(message)
        self.pid = pid


class TrialsFailedError(AutoshardError):
    """The trials failed in a way that no other configuration can avoid (the same error on
    configurations that share no setting): the model or its arguments need fixing."""


class StudyNotice(UserWarning):
    """One line about the study's storage that needs no action but should be seen: a repaired
    ``trials.jsonl``, a database rebuilt from it, a wait for another run's lock. The command line
    prints it; in Python it is a warning (``TuneOptions.on_notice`` receives it instead)."""


class TrialNotice(UserWarning):
    """One line about how trials ran that needs no action: a worker group restarted because a
    trial left memory behind, an OOM tried once more in a fresh group. The command line prints
    it; in Python it is a warning (``TuneOptions.on_notice`` receives it instead)."""


class HandoverNotice(UserWarning):
    """One line about what autoshard hands to the user's stack: what ``rec.apply(model)``
    applied, on which device (each rank's CUDA device, or the CPU with gloo) and where that
    differs from the plan; or a setting a stack cannot express as chosen, with the closest
    faithful setting used instead. A warning: ``warnings.simplefilter("error", HandoverNotice)``
    makes each one an exception.

    >>> import autoshard
    >>> issubclass(autoshard.HandoverNotice, UserWarning)
    True
    """


class PlanWarning(UserWarning):
    """A number autoshard had to assume or guess: it says which and how to give the real one.

    >>> import warnings
    >>> import autoshard
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     _ = autoshard.estimate("examples/gpt.py:build", kwargs={"size": "tiny"}, gpus=8)
    >>> [str(w.message).split(":")[0] for w in caught if w.category is autoshard.PlanWarning]
    ['no GPU visible and no gpu/gpu_memory given', 'seq_len 256']
    """


class NoGPUWarning(PlanWarning):
    """No CUDA GPU is visible: trials run on CPU processes, and the GPUs are the ones given.

    Silence it where planning for GPUs that are not at hand is the point:

    >>> import warnings
    >>> from autoshard import NoGPUWarning, detect_hardware
    >>> with warnings.catch_warnings():
    ...     warnings.simplefilter("ignore", NoGPUWarning)
    ...     cluster = detect_hardware(gpus=8, nodes=4, gpu_memory="80GiB")
    >>> cluster.world_size
    32
    """
