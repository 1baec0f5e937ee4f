"""Shared-memory segments carry their run's id, and the launcher removes what a killed
rank left behind (`sweep_segments`), only of its own run."""

from __future__ import annotations

import pytest

from mpress.d2d.runtime.transport import RUN_ID_ENV, SHM_DIR, create_segment, run_prefix, sweep_segments

pytestmark = pytest.mark.skipif(not SHM_DIR.is_dir(), reason="no /dev/shm")


def test_segments_of_a_run_are_named_by_it_and_swept_by_it(monkeypatch):
    monkeypatch.setenv(RUN_ID_ENV, "testsweepA")
    mine = create_segment(64)
    monkeypatch.setenv(RUN_ID_ENV, "testsweepB")
    other = create_segment(64)
    try:
        assert mine.name.startswith(run_prefix("testsweepA")) and (SHM_DIR / mine.name).exists()
        # the rank was killed before it could unlink: only the launcher's sweep removes it
        assert sweep_segments("testsweepA") == [mine.name]
        assert not (SHM_DIR / mine.name).exists() and (SHM_DIR / other.name).exists()
    finally:
        for shm in (mine, other):
            shm.close()
            try:
                shm.unlink()
            except FileNotFoundError:
                pass
