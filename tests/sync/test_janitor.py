"""The creator removes its segments in every exit path; nothing else is touched."""

from __future__ import annotations

import os
import signal
import tempfile

import pytest

from gramcoord.sync.janitor import PREFIX, Janitor, remove
from tests.load import scaled
from tests.sync.transport_peers import ring_owner_main, shm_names, wait_until


@pytest.mark.spawn
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("ending", "send", "exitcode"),
    [
        pytest.param("return", None, 0, id="exit-without-close-atexit"),
        pytest.param("os-exit", None, 0, id="os-exit-reaper"),
        pytest.param("wait", signal.SIGTERM, -signal.SIGTERM, id="SIGTERM-handler"),
        pytest.param("wait", signal.SIGINT, 1, id="SIGINT-keyboard-interrupt"),
        pytest.param("wait", signal.SIGKILL, -signal.SIGKILL, id="SIGKILL-reaper"),
        pytest.param("prior-handler", signal.SIGTERM, 3, id="SIGTERM-chains-prior-handler"),
    ],
)
def test_owner_leaves_no_segment_however_it_ends(peers, run_id, ending, send, exitcode):
    out = peers.queue()
    owner = peers.start(ring_owner_main, run_id, out, ending)
    _, what, name, _, _ = out.get(timeout=scaled(60))
    assert what == "created" and name.startswith(f"{PREFIX}-{run_id}-")
    if send is not None:
        os.kill(owner.pid, send)
    owner.join(30)
    assert owner.exitcode == exitcode
    if ending == "prior-handler":
        assert out.get(timeout=10)[1:3] == ("prior-ran", signal.SIGTERM)
    wait_until(lambda: not shm_names(run_id), 15, f"{name} to be removed")


def test_reaper_removes_what_its_owner_still_held_when_the_pipe_closes(run_id):
    janitor = Janitor()
    kept = tempfile.mkdtemp(prefix=f"{PREFIX}-{run_id}-kept-")
    released = tempfile.mkdtemp(prefix=f"{PREFIX}-{run_id}-released-")
    janitor.own("dir", kept)
    janitor.own("dir", released)
    janitor.disown("dir", released)
    reaper = janitor._reaper
    assert reaper is not None
    reaper.stdin.close()  # what the kernel does when the owner dies
    assert reaper.wait(30) == 0
    assert not os.path.exists(kept)
    assert os.path.isdir(released)  # disowned: the owner removes it, not the reaper
    os.rmdir(released)
    janitor.disown("dir", kept)


@pytest.mark.parametrize(
    ("kind", "name"),
    [
        pytest.param("shm", "psm_not_ours", id="foreign-shm"),
        pytest.param("dir", "/tmp/not-ours", id="foreign-dir"),
        pytest.param("dir", f"relative/{PREFIX}-x", id="relative-dir"),
        pytest.param("file", f"{PREFIX}-x", id="unknown-kind"),
    ],
)
def test_only_our_own_names_are_ever_removed(kind, name):
    assert remove(kind, name) is False
    with pytest.raises(ValueError):
        Janitor().own(kind, name)


def test_cleanup_removes_everything_owned(run_id):
    janitor = Janitor()
    path = tempfile.mkdtemp(prefix=f"{PREFIX}-{run_id}-")
    janitor.own("dir", path)
    assert janitor.owned() == {("dir", path)}
    janitor.cleanup()
    assert not os.path.exists(path)
    assert janitor.owned() == set()
    janitor.disown("dir", path)
    janitor._reaper.stdin.close()  # this test's reaper: let it exit now
    assert janitor._reaper.wait(30) == 0
