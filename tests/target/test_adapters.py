"""A model object given in Python (target/adapters.py): saved in a folder of this user's own,
never a predictable shared path, and nothing unpickled from a path another user could write.
Moved from tests/test_secrets.py (issue 36), which keeps that no file of a tune holds a
password."""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

import pytest
import torch
from torch import nn

from autoshard.errors import TargetError
from autoshard.target import adapters
from autoshard.target.adapters import load_saved_model, to_target


class Planted:
    """What a hostile pickle runs when it is loaded: it writes a file."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path(self.marker).write_text, ("unpickled",))


def test_a_planted_symlink_in_the_old_shared_folder_is_not_followed(tmp_path, monkeypatch):
    """Another user creates $TMPDIR/autoshard-targets first and plants, at the name the model
    would get, a symlink to a victim file and a pickle that runs code: to_target writes neither,
    and the victim is untouched."""
    shared = tmp_path / "tmp"
    shared.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(shared))
    planted = shared / "autoshard-targets"
    planted.mkdir(mode=0o777)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    model = nn.Sequential(nn.Linear(4, 4))
    name = f"model-{adapters._digest_module(model)}.pt"
    (planted / name).symlink_to(victim)
    spec = to_target(model)
    path = Path(spec.kwargs["path"])
    assert victim.read_text() == "precious"
    assert planted not in path.parents, path
    folder = path.parent
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700 and folder.stat().st_uid == os.getuid()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    loaded = load_saved_model(str(path))
    assert isinstance(loaded, nn.Sequential)


def test_nothing_is_unpickled_from_a_path_another_user_can_write(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # a folder anyone can write, like /tmp
    bad = shared / "model.pt"
    torch.save({"model": Planted(str(marker)), "batch": None}, bad)
    with pytest.raises(TargetError, match="not a private folder"):
        load_saved_model(str(bad))
    assert not marker.exists()
    # a symlink to it from a private folder is no way around it
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    (private / "model.pt").symlink_to(bad)
    with pytest.raises(TargetError):
        load_saved_model(str(private / "model.pt"))
    assert not marker.exists()


def test_a_saved_batch_is_read_without_unpickling_code(tmp_path: Path) -> None:
    """A batch holds tensors: it is read with weights_only=True even from autoshard's folder."""
    marker = tmp_path / "ran"
    spec = to_target("tests/targets/faults.py:build", batch=torch.zeros(2, 16, dtype=torch.long),
                     out_dir=tmp_path / "out")  # fmt: skip
    batch_path = Path(spec.kwargs["batch_path"])
    torch.save(Planted(str(marker)), batch_path)  # replaced by a hostile pickle
    with pytest.raises(TargetError):
        adapters.with_saved_batch(**spec.kwargs)
    assert not marker.exists()
