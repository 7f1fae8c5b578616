"""The rank's step loop (service.worker.rank._steps) with lookahead, on the CPU: a fake layer whose
"device" buffers are CPU tensors and CUDA events that complete at once, so the loop takes its CUDA
path (steps in flight, per-step state, the answer's copy enqueued right after the layer). Checked:
the order of enqueues and finishes, answers in seq order and right, ping and stop after what is in
flight, a failing check of step n answering nothing after n, each step checked from its own state."""

from __future__ import annotations

import logging
import multiprocessing as mp
import threading
import time
import types

import pytest
import torch

from service.config import LayerConfig
from service.moe import routing
from service.moe.layer import StepState
from service.moe.timing import StageTimer
from service.worker import rank as rank_mod
from service.worker.rank import RankOptions

CFG = LayerConfig(E=4, H=24, I=16, K=2, R=1, C=37, dtype=torch.bfloat16)
CPU = torch.device("cpu")


class InstantEvent:
    """torch.cuda.Event's surface, for a device whose work is done when it is enqueued."""

    def __init__(self, enable_timing: bool = False):
        self.recorded = False

    def record(self) -> None:
        self.recorded = True

    def synchronize(self) -> None:
        assert self.recorded, "waited for an event that was never recorded"

    def query(self) -> bool:
        assert self.recorded
        return True

    def elapsed_time(self, other: InstantEvent) -> float:
        assert self.recorded and other.recorded
        return 0.0


class GatedEvent(InstantEvent):
    """An event whose work completes when the test opens `gate` (a device still computing);
    `waited` is set once the rank blocks on one (it has enqueued what it will before finishing)."""

    gate = threading.Event()
    waited = threading.Event()

    def query(self) -> bool:
        assert self.recorded
        return self.gate.is_set()

    def synchronize(self) -> None:
        assert self.recorded
        self.waited.set()
        assert self.gate.wait(timeout=10), "waited for a step the test never completed"


class FakeLayer:
    """A Layer whose step writes x * seq into one output buffer and seq into one "device" word,
    both overwritten by the next step (as the real layers' buffers are)."""

    name = "fake"

    def __init__(self, fail_seq: int | None = None):
        self.calls: list[tuple[str, int]] = []
        self.fail_seq = fail_seq
        self.device_seq = torch.zeros(1, dtype=torch.int64)           # the step's state on the "device"
        self.out = torch.empty(CFG.C, CFG.H)                           # [C, H] fp32
        self.inputs = (torch.empty(CFG.C, CFG.H, dtype=CFG.dtype),     # [C, H]
                       torch.empty(CFG.C, CFG.K, dtype=torch.int32),   # [C, K]
                       torch.empty(CFG.C, CFG.K))                      # [C, K]

    def new_state(self) -> StepState:
        return StepState(StageTimer(CPU), torch.zeros(1, dtype=torch.int64))

    def forward(self, x, ids, w, seq, timer=None, state=None):
        assert x.data_ptr() == self.inputs[0].data_ptr(), "the rank copies its rows into layer.inputs"
        assert state is not None, "the rank passes its lane's state"
        timer = state.timer
        timer.start()
        self.calls.append(("forward", seq))
        self.device_seq[0] = seq
        n = x.shape[0]
        torch.mul(x.float(), seq, out=self.out[:n])
        timer.mark("fake")
        state.words.copy_(self.device_seq)  # the step's snapshot
        return self.out[:n]

    def check_seq(self, seq, state=None):
        self.calls.append(("check", seq))
        if seq == self.fail_seq:
            raise routing.SequenceMismatch(f"step {seq} failed its check")
        routing.check_seqs(state.words.tolist(), seq, 0)  # this step's own snapshot, not the last step's

    def exposed_comm_s(self, state=None):
        return 0.0


def make_slots(gen: torch.Generator, n: int):
    N = CFG.tokens_per_step
    return [types.SimpleNamespace(
        index=i, x=torch.randn(N, CFG.H, generator=gen).to(CFG.dtype),
        ids=torch.randint(0, CFG.E, (N, CFG.K), generator=gen, dtype=torch.int32),
        w=torch.rand(N, CFG.K, generator=gen), out=torch.full((N, CFG.H), float("nan"), dtype=CFG.dtype))
        for i in range(n)]


class FakeStream:
    """torch.cuda.Stream's surface for a device that runs everything in order at once: the loop's
    copy-stream path is then a matter of which buffers it copies through."""

    def __init__(self, device=None):
        self.waited: list = []

    def wait_event(self, event) -> None:
        assert event.recorded, "a stream waits for an event recorded before it"
        self.waited.append(event)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None


def run_loop(monkeypatch, messages, lookahead: int, layer: FakeLayer, slots, event=InstantEvent, pipe=None,
             copy_streams: bool = False, idle_spin_s: float = 0.0):
    """Queue `messages` on the rank's pipe, run the loop to its end; (answers read back, raised)."""
    monkeypatch.setattr(torch.cuda, "Event", event)
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: FakeStream())
    parent, child = pipe or mp.Pipe()
    for msg in messages:
        parent.send(msg)
    opts = RankOptions(cfg=CFG, device="cuda", store_host="", store_port=0, slot_paths=(), lookahead=lookahead,
                       copy_streams=copy_streams, idle_spin_s=idle_spin_s)
    raised = None
    try:
        rank_mod._steps(0, CFG, opts, child, logging.getLogger("test"), layer, slots, layer.inputs)
    except Exception as err:  # noqa: BLE001 - the test inspects it
        raised = err
    answers = []
    while parent.poll(0):
        answers.append(parent.recv())
    return answers, raised


STEPS_T = (1, 37, 20, 9)  # T per step: one token, the capacity, odd sizes


def steps(first: int = 1):
    return [("step", first + i, i, T) for i, T in enumerate(STEPS_T)]


@pytest.mark.parametrize("copy_streams", [False, True])
@pytest.mark.parametrize("lookahead", [1, 2])
def test_steps_answer_in_order_with_the_right_rows(monkeypatch, lookahead, copy_streams):
    gen = torch.Generator().manual_seed(11)
    slots = make_slots(gen, len(STEPS_T))
    layer = FakeLayer()
    answers, raised = run_loop(monkeypatch, [*steps(), ("stop",)], lookahead, layer, slots,
                               copy_streams=copy_streams)
    assert raised is None
    assert [(a[0], a[2]) for a in answers] == [("done", s) for s in range(1, len(STEPS_T) + 1)]
    for (_, seq, i, T), answer in zip(steps(), answers, strict=True):
        stats = answer[3]
        assert stats["tokens"] == T and set(stats["stages"]) == {"fake", "copy_in"}
        stamps = stats["stamps"]
        assert len(stamps) == 6 and list(stamps) == sorted(stamps)  # cut points of the step's phases, in order
        want = (slots[i].x[:T].float() * seq).to(CFG.dtype)  # computed before the next step overwrote layer.out
        assert torch.equal(slots[i].out[:T], want), f"step {seq}'s answer"
        assert slots[i].out[T:].isnan().all(), "rows past T untouched"
    assert [a[3]["behind"] for a in answers] == [False] + [lookahead == 2] * (len(STEPS_T) - 1)
    if lookahead == 2:  # every step after the first was enqueued before the one ahead of it finished
        assert layer.calls == [("forward", 1), ("forward", 2), ("check", 1), ("forward", 3), ("check", 2),
                               ("forward", 4), ("check", 3), ("check", 4)]
    else:
        assert layer.calls == [c for s in range(1, 5) for c in (("forward", s), ("check", s))]


def test_ping_and_stop_answer_after_the_steps_in_flight(monkeypatch):
    gen = torch.Generator().manual_seed(12)
    slots = make_slots(gen, len(STEPS_T))
    layer = FakeLayer()
    s = steps()
    answers, raised = run_loop(monkeypatch, [s[0], s[1], ("ping", 2), s[2], s[3], ("stop",)], 2, layer, slots)
    assert raised is None
    assert [(a[0], a[2]) for a in answers] == [("done", 1), ("done", 2), ("pong", 2), ("done", 3), ("done", 4)]
    # stop arrived with step 4 in flight (3 finished only when 4 was enqueued): 4 was finished and answered first
    assert layer.calls[-3:] == [("forward", 4), ("check", 3), ("check", 4)]


def test_a_failing_check_answers_nothing_after_its_step(monkeypatch):
    gen = torch.Generator().manual_seed(13)
    slots = make_slots(gen, len(STEPS_T))
    layer = FakeLayer(fail_seq=2)
    answers, raised = run_loop(monkeypatch, [*steps(), ("stop",)], 2, layer, slots)
    assert isinstance(raised, routing.SequenceMismatch)
    assert [(a[0], a[2]) for a in answers] == [("done", 1)]  # step 3 was enqueued, never answered
    assert ("forward", 3) in layer.calls and ("check", 3) not in layer.calls


def test_a_step_out_of_sequence_is_refused(monkeypatch):
    gen = torch.Generator().manual_seed(14)
    layer = FakeLayer()
    answers, raised = run_loop(monkeypatch, [("step", 1, 0, 5), ("step", 3, 1, 5)], 2, layer, make_slots(gen, 2))
    assert isinstance(raised, RuntimeError) and "expected seq 2, got 3" in str(raised)
    assert "step seq 3" in str(raised)  # the error names the message that broke the sequence
    # step 1 was in flight and good: it is answered before the rank fails on the message behind it
    assert [(a[0], a[2]) for a in answers] == [("done", 1)]


def test_a_step_that_fails_to_enqueue_is_named_after_the_step_ahead_is_answered(monkeypatch):
    gen = torch.Generator().manual_seed(15)
    layer = FakeLayer()
    real_forward = layer.forward

    def forward(x, ids, w, seq, timer=None, state=None):
        if seq == 2:
            raise ValueError("the device refused")
        return real_forward(x, ids, w, seq, timer, state)

    layer.forward = forward
    answers, raised = run_loop(monkeypatch, [("step", 1, 0, 5), ("step", 2, 1, 5)], 2, layer, make_slots(gen, 2))
    assert isinstance(raised, RuntimeError) and "step seq 2: ValueError: the device refused" in str(raised)
    assert [(a[0], a[2]) for a in answers] == [("done", 1)]


def test_a_step_arriving_while_the_device_computes_is_enqueued_at_once(monkeypatch):
    """Step 2's message comes after the rank enqueued step 1 and while step 1's layer still runs:
    the rank enqueues step 2 before it finishes step 1 (it polls the pipe and step 1's event)."""
    gen = torch.Generator().manual_seed(15)
    slots = make_slots(gen, 2)
    layer = FakeLayer()
    GatedEvent.gate.clear()
    GatedEvent.waited.clear()
    parent, child = mp.Pipe()

    def feeder() -> None:
        def until(call):
            deadline = time.monotonic() + 10
            while call not in layer.calls and time.monotonic() < deadline:
                time.sleep(0.001)
        parent.send(("step", 1, 0, 5))
        until(("forward", 1))
        parent.send(("step", 2, 1, 37))
        until(("forward", 2))
        # Open the gate only once the rank waits on step 1: "forward 2" is booked inside the layer's
        # forward, before the rank asks whether step 1's layer still runs (opening it then raced that
        # question and failed CI once).
        GatedEvent.waited.wait(timeout=10)
        GatedEvent.gate.set()  # the device finishes both
        parent.send(("stop",))

    thread = threading.Thread(target=feeder)
    thread.start()
    try:
        answers, raised = run_loop(monkeypatch, [], 2, layer, slots, event=GatedEvent, pipe=(parent, child))
    finally:
        GatedEvent.gate.set()
        thread.join(timeout=10)
    assert raised is None
    assert layer.calls == [("forward", 1), ("forward", 2), ("check", 1), ("check", 2)]
    assert [(a[0], a[2], a[3]["behind"]) for a in answers] == [("done", 1, False), ("done", 2, True)]
    assert [a[3]["overlapped"] for a in answers] == [False, True]  # step 1's layer still ran at step 2's enqueue


@pytest.mark.parametrize("idle_spin_s", [0.0, 0.25])
def test_an_idle_rank_polls_its_pipe_for_idle_spin_s_then_blocks(monkeypatch, idle_spin_s):
    """After its answer a rank with nothing in flight spins (its thread's CPU clock runs) for idle_spin_s,
    then blocks in the read (the clock stops); 0 blocks at once. The next step is still taken either way."""
    gen = torch.Generator().manual_seed(17)
    slots = make_slots(gen, 2)
    parent, child = mp.Pipe()
    clock = time.pthread_getcpuclockid(threading.get_ident())  # the loop runs in this thread
    used: dict[str, float] = {}

    def cpu_over(seconds: float) -> float:
        t0 = time.clock_gettime(clock)
        time.sleep(seconds)
        return time.clock_gettime(clock) - t0

    def feeder() -> None:
        parent.send(("step", 1, 0, 5))
        assert parent.poll(10), "no answer to step 1"  # (left in the pipe: run_loop reads every answer)
        used["in the window"] = cpu_over(0.15)  # 0-0.15 s after the answer
        time.sleep(0.25)
        used["past it"] = cpu_over(0.15)  # 0.4-0.55 s after it
        parent.send(("step", 2, 1, 9))
        parent.send(("stop",))

    thread = threading.Thread(target=feeder)
    thread.start()
    try:
        answers, raised = run_loop(monkeypatch, [], 1, FakeLayer(), slots, pipe=(parent, child),
                                   idle_spin_s=idle_spin_s)
    finally:
        thread.join(timeout=10)
    assert raised is None
    assert [(a[0], a[2]) for a in answers] == [("done", 1), ("done", 2)]
    assert used["past it"] < 0.03, used  # blocked: its CPU clock stood still
    if idle_spin_s:
        assert used["in the window"] > 0.05, used  # spinning: most of a core
    else:
        assert used["in the window"] < 0.03, used


def test_the_idle_spin_setting_reaches_the_ranks_options(monkeypatch):
    """--rank-idle-spin-ms (milliseconds) -> the server's group (idle_spin_s) -> every rank's RankOptions."""
    from service.config import Settings
    from service.server import Server
    from service.worker import group as group_mod

    group = Server(Settings(device="cpu", rank_idle_spin_ms=3.5))._new_group()
    assert group.idle_spin_s == pytest.approx(0.0035)
    made: list[float] = []

    class Stop(Exception):
        pass

    def options(**kwargs):
        made.append(kwargs["idle_spin_s"])
        raise Stop  # nothing is spawned: the start fails here and cleans up

    monkeypatch.setattr(group_mod, "RankOptions", options)
    with pytest.raises(Stop):
        group.start()
    assert made == [pytest.approx(0.0035)] and not group.alive


def test_copy_streams_record_and_wait_on_the_right_streams(monkeypatch):
    """--rank-copy-streams: each step's rows' events are recorded on the in-stream and waited by the
    layer's stream before its device copy; its answer's DMA waits on the layer's event and is done
    on the out-stream (the event the host syncs before it answers). Wrong streams pass the other
    tests, whose fake streams run everything in order."""
    current = ["compute"]
    log: list[tuple] = []

    class Stream:
        made = 0

        def __init__(self, device=None, name=None):
            if name is None:
                Stream.made += 1
                name = ("in", "out")[Stream.made - 1]
            self.name = name

        def wait_event(self, event) -> None:
            assert event.stream is not None, "waits for an event never recorded"
            log.append(("wait", self.name, event.stream))

    class Event(InstantEvent):
        def __init__(self, enable_timing: bool = False):
            super().__init__()
            self.stream = None

        def record(self) -> None:
            super().record()
            self.stream = current[-1]
            log.append(("record", id(self), self.stream))

    class Use:
        def __init__(self, stream):
            self.stream = stream

        def __enter__(self):
            current.append(self.stream.name)

        def __exit__(self, *exc) -> None:
            current.pop()

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "stream", Use)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream(name="compute"))
    gen = torch.Generator().manual_seed(16)
    slots = make_slots(gen, 2)
    layer = FakeLayer()
    parent, child = mp.Pipe()
    for msg in (("step", 1, 0, 5), ("step", 2, 1, 37), ("stop",)):
        parent.send(msg)
    opts = RankOptions(cfg=CFG, device="cuda", store_host="", store_port=0, slot_paths=(), lookahead=2,
                       copy_streams=True)
    rank_mod._steps(0, CFG, opts, child, logging.getLogger("test"), layer, slots, layer.inputs)
    events = [e[2] if e[0] == "record" else ("wait", e[1], e[2]) for e in log]
    # per step: copied_in[0], copied_in[1] on "in"; compute waits an "in" event; layer_done on compute;
    # "out" waits a compute event; done on "out"
    one_step = ["in", "in", ("wait", "compute", "in"), "compute", ("wait", "out", "compute"), "out"]
    assert events == one_step * 2, events
    for i, slot in enumerate(slots[:2]):
        T = (5, 37)[i]
        assert torch.equal(slot.out[:T], (slot.x[:T].float() * (i + 1)).to(CFG.dtype))


def test_a_device_error_at_a_steps_event_names_the_step(monkeypatch):
    """A fault that surfaces when the rank waits for step 2's events is raised naming step 2, after
    step 1 was answered."""

    class FaultOnSecond(InstantEvent):
        made = 0

        def __init__(self, enable_timing: bool = False):
            super().__init__()
            FaultOnSecond.made += 1
            self.lane = (FaultOnSecond.made - 1) // 4  # the loop makes 4 events per lane, lane by lane

        def synchronize(self) -> None:
            super().synchronize()
            if self.lane == 0:  # lane 0 holds the even steps: step 2
                raise RuntimeError("CUDA error: an illegal memory access was encountered")

    gen = torch.Generator().manual_seed(17)
    layer = FakeLayer()
    answers, raised = run_loop(monkeypatch, [("step", 1, 0, 5), ("step", 2, 1, 5), ("stop",)], 2, layer,
                               make_slots(gen, 2), event=FaultOnSecond)
    assert isinstance(raised, RuntimeError) and "step seq 2 (on the device)" in str(raised), raised
    assert "illegal memory access" in str(raised)
    assert [(a[0], a[2]) for a in answers] == [("done", 1)]
