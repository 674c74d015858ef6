"""Reading a worker log (autoshard.trials.crashlog): the most telling line, never a warning nor
another rank's echo, and torchrun's root cause."""

from __future__ import annotations

import signal

from autoshard.trials.crashlog import crash_cause, last_error_line

FUTURE_WARNING = """\
/venv/torch/distributed/fsdp/_init_utils.py:430: FutureWarning: FSDP.state_dict_type() is being deprecated. Error-prone use.
  _init_core_state(
"""

TORCHRUN_SUMMARY = """\
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
autoshard.trials.worker FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-11-23_13:16:51
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 17822)  (SIGTERM)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 17822
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-23_13:16:51
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : {code} (pid: 17823) {name}
  error_file: <N/A>
  traceback : {traceback}
============================================================
"""


def _summary(code: int) -> str:
    if code < 0:
        name = signal.Signals(-code).name
        return TORCHRUN_SUMMARY.format(
            code=code, name=f"({name})", traceback=f"Signal {-code} ({name}) received by PID 1"
        )
    return TORCHRUN_SUMMARY.format(code=code, name="", traceback="To enable traceback see: x")


def test_a_warning_is_never_the_error_line() -> None:
    # A hang leaves nothing but warnings: no error line, not the warning's source line.
    assert last_error_line(FUTURE_WARNING, fallback=False) == ""
    assert last_error_line("started\n" + FUTURE_WARNING) == "started"
    crash = "Traceback (most recent call last):\nValueError: n_layer must be positive\n"
    assert last_error_line(crash + FUTURE_WARNING) == "ValueError: n_layer must be positive"
    ranked = "[rank1]: torch.OutOfMemoryError: CUDA out of memory\n" + _summary(1)
    assert last_error_line(ranked) == "[rank1]: torch.OutOfMemoryError: CUDA out of memory"


def test_the_signal_line_of_torchrun_when_no_worker_raised() -> None:
    assert last_error_line(FUTURE_WARNING + _summary(-9)).endswith(
        "Signal 9 (SIGKILL) received by PID 1"
    )
    assert last_error_line(_summary(3), fallback=False) == ""


def test_the_root_cause_is_the_first_failure_not_the_ranks_torchrun_stopped() -> None:
    killed = crash_cause(_summary(-9))
    assert (killed.rank, killed.exitcode, killed.signal) == (1, -9, 9)
    exited = crash_cause(_summary(3))  # the SIGTERM of rank 0 is torchrun's, not the cause
    assert (exited.rank, exited.exitcode, exited.signal) == (1, 3, None)
    assert crash_cause("no summary at all").exitcode is None
