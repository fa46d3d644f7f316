"""A persistent world survives idle time (ranks forked from the forkserver have the server,
not the test process, as their parent: an orphan check on the parent pid must not kill them)."""
import time

from tplayers.testing import get_world


def _rank(group):
    return group.rank()


def test_world_stays_up_while_idle():
    world = get_world(2)
    assert world.run(_rank) == [0, 1]
    starts = world.starts
    time.sleep(2.5)  # ranks poll their pipe every second
    assert world.alive
    assert world.run(_rank) == [0, 1]
    assert world.starts == starts, "the world was restarted after being idle"
