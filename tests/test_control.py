"""The run's control actor (elastic/train/control.py): its readers' standing questions
are answered the moment there is news, and news is handed over once."""

from __future__ import annotations

import threading
import time

from elastic.train.control import RunControl, StopPoller


def test_a_stop_answers_rank_0s_standing_question_at_once():
    control = RunControl()
    got: list[str | None] = []
    asker = threading.Thread(target=lambda: got.append(control.wait_stop(60.0)))
    asker.start()
    time.sleep(0.2)
    assert got == [], "the question came back with no stop asked"
    control.request_stop("SIGUSR1")
    asker.join(timeout=10)  # far under the question's 60 s: answered by the news
    assert got == ["SIGUSR1"]
    assert control.wait_stop(60.0) == "SIGUSR1"  # asked again: at once
    assert RunControl().wait_stop(0.05) is None  # no stop: None when it times out


def test_the_driver_hears_each_piece_of_news_at_once_and_each_eviction_once():
    control = RunControl()
    seen, (fatal, progress, taken, starting_since) = control.wait_status(0, 0.05)
    assert (seen, fatal, progress, taken) == (0, None, None, [])
    assert starting_since is not None  # no worker group up yet, the first being started
    answers: list[tuple] = []
    asker = threading.Thread(target=lambda: answers.append(control.wait_status(seen, 60.0)))
    asker.start()
    time.sleep(0.2)
    control.evict({"node_id": "n1", "cooldown_s": 30})
    asker.join(timeout=10)
    seen, (fatal, progress, taken, _) = answers[0]
    assert seen == 1 and fatal is None and taken == [{"node_id": "n1", "cooldown_s": 30}]
    control.progress(step=40, epoch=1, loss=0.5, world=2, samples_per_s=100.0)
    seen, (_, progress, taken, _) = control.wait_status(seen, 60.0)
    assert seen == 2 and progress is not None and progress["step"] == 40
    assert taken == [], "an eviction handed to the driver twice"
    control.fail("bad row 7 in shard-00003.parquet")
    seen, status = control.wait_status(seen, 60.0)
    assert (seen, status[0]) == (3, "bad row 7 in shard-00003.parquet")
    assert control.wait_status(3, 0.05)[0] == 3  # nothing new: the count stays


def test_the_driver_hears_whether_a_worker_group_is_up_or_being_started():
    """Ray Train's controller (its callback) tells each change: a group up, none up
    while one is started (since when: the driver ends a stop or a placement there),
    none up because the run is ending."""
    control = RunControl()
    control.controller_state(True, False)
    seen, status = control.wait_status(0, 60.0)
    assert status[3] is None
    before = time.time()
    control.controller_state(False, True)  # the group failed: started again
    seen, status = control.wait_status(seen, 60.0)
    assert status[3] is not None and status[3] >= before
    control.controller_state(False, True)  # the same state again: no news
    assert control.wait_status(seen, 0.05)[0] == seen
    control.controller_state(False, False)  # shutting down: nothing being started
    assert control.wait_status(seen, 60.0)[1][3] is None


def test_rank_0_learns_of_a_stop_without_asking_again(ray_session):
    """Through Ray: rank 0's poller keeps one question out (each actor call costs CPU
    on the training cores) and sees the stop well inside the question's wait."""
    import ray

    from elastic.train.control import STOP_WAIT_S, start_control

    control = start_control()
    try:
        poller = StopPoller(control)
        assert poller.poll() is None
        question = poller._pending
        for _ in range(5):
            assert poller.poll() is None
        assert poller._pending is question, "asked again before the first came back"
        ray.get(control.request_stop.remote("SIGTERM"))
        deadline = time.monotonic() + STOP_WAIT_S / 2
        while poller.poll() is None:
            assert time.monotonic() < deadline, "the stop waited for the question to time out"
            time.sleep(0.05)
        assert poller.reason == "SIGTERM"
    finally:
        ray.kill(control)
