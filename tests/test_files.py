"""state.files: the one atomic-write implementation every small in-place file goes through."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from hotfit.core.errors import DiskSpaceError

from hotfit.pipeline.registry_lock import write_atomic
from hotfit.state.files import finalize_file, write_text_atomic

TIER = "unit"


@pytest.mark.parametrize("durable", [True, False])
def test_replace_keeps_mode_and_leaves_no_temp(tmp_path: Path, durable: bool) -> None:
    target = tmp_path / "sub" / "x.json"
    write_text_atomic(target, "one", durable=durable)
    assert target.read_text() == "one" and (target.stat().st_mode & 0o777) == 0o644
    os.chmod(target, 0o600)
    write_text_atomic(target, "two", durable=durable)
    assert target.read_text() == "two" and (target.stat().st_mode & 0o777) == 0o600
    assert sorted(p.name for p in target.parent.iterdir()) == ["x.json"]


# registry_lock.write_atomic (the registry file's writer) is one of the callers: the same failure, through it
@pytest.mark.parametrize("write", [write_text_atomic, write_atomic], ids=["write_text_atomic", "registry_lock"])
def test_failed_write_keeps_the_old_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         write: Callable[[Path, str], None]) -> None:
    target = tmp_path / "x.json"
    write_text_atomic(target, "old")

    def boom(*_a: object) -> None:  # the rename never happens (power cut before it)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(DiskSpaceError) as err:  # a full disk is exit 4 naming the file and the bytes
        write(target, "new")
    assert err.value.details["path"] == str(target) and err.value.details["needed_bytes"] == 3
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["x.json"]


def test_finalize_moves_the_partial_into_place(tmp_path: Path) -> None:
    partial = tmp_path / ".partial" / "m.gguf.part"
    partial.parent.mkdir()
    partial.write_bytes(b"GGUF" + b"\0" * 60)
    final = tmp_path / "models" / "m.gguf"
    finalize_file(partial, final)
    assert final.read_bytes()[:4] == b"GGUF" and not partial.exists()
