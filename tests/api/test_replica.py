"""A front end's steps through the owner (service.replica.RemoteGroup), without processes."""

from __future__ import annotations

import multiprocessing as mp
import threading
import time
import types

import pytest

from service.errors import GroupUnavailable
from service.replica import RemoteGroup


def test_a_late_answer_to_a_given_up_step_is_never_taken_by_the_next_group():
    """Group A gives up on its step (no answer within its timeout); the owner answers it later. Group B,
    attached on the same slot connection, must get the answer to its own step, not A's late one."""
    here, owner = mp.Pipe()
    slot = types.SimpleNamespace(index=0)
    sent = [0]  # kept by the replica across groups

    def serve():  # the owner: step 1 answered late, every later step at once, each with its number
        for _ in range(2):
            _, gen, n, T = owner.recv()
            if n == 1:
                time.sleep(0.4)
            owner.send(("done", n, {"gen": gen, "n": n}))

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    a = RemoteGroup(1, "fused", [slot], [here], sent, timeout_s=0.1)
    with pytest.raises(GroupUnavailable, match="did not answer"):
        a.run(slot, 8)
    assert not a.alive
    time.sleep(0.5)  # A's answer is in the pipe now
    b = RemoteGroup(2, "fused", [slot], [here], sent, timeout_s=5.0)
    assert b.run(slot, 8) == {"gen": 2, "n": 2}
    t.join(5)
