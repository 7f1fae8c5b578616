"""The exception tree's own promises: a rank's traceback goes to the log, never to a client."""

from __future__ import annotations

from service.api.error_map import message
from service.errors import WorkerError

TRACEBACK = 'Traceback (most recent call last):\n  File "/srv/service/worker/rank.py", line 75\nKeyboardInterrupt\n'


def test_a_worker_error_sent_as_text_keeps_its_traceback_out_of_the_answer():
    """service.fleet sends a WorkerError to the other front ends as its text (message and rank
    traceback) and service.replica raises WorkerError(text) there: the client's message must be the
    owner's ("the rank group failed (...); retry shortly"), the traceback still in str() for the
    log. Before, front end 1's clients got the traceback, with the server's paths and source."""
    owner = WorkerError("step 84: rank 0 raised", rank=0, traceback=TRACEBACK)
    relayed = WorkerError(str(owner))
    assert message(relayed) == message(owner) == "the rank group failed (step 84: rank 0 raised); retry shortly"
    assert (relayed.rank, relayed.traceback) == (0, TRACEBACK)
    assert str(relayed) == str(owner)


def test_a_worker_error_without_a_traceback_is_its_message():
    err = WorkerError("step 3: rank 2 died (exit code -9)", rank=2)
    assert str(err) == "step 3: rank 2 died (exit code -9)"
    assert message(WorkerError(str(err))) == "the rank group failed (step 3: rank 2 died (exit code -9)); retry shortly"
