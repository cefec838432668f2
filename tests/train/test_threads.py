"""The CPU thread count a run steps with (train/threads.py): measured on the run's own steps,
kept while it stays fastest, measured again when the load changes, off when the user chose."""

from __future__ import annotations

import torch

from doel.train.threads import ThreadChooser, thread_hook, wanted


class FakeMachine:
    """Step times by thread count, changeable mid-run (the load arriving or leaving)."""

    def __init__(self, seconds: dict[int, float]):
        self.seconds, self.now, self.threads, self.history = seconds, 0.0, 2, []

    def set_threads(self, n: int) -> None:
        self.threads = n

    def clock(self) -> float:
        return self.now

    def steps(self, chooser: ThreadChooser, n: int) -> None:
        for _ in range(n):
            self.now += self.seconds[self.threads]
            self.history.append(self.threads)
            chooser(len(self.history))


def _chooser(machine, logged):
    return ThreadChooser(
        [2, 1], log=logged.append, clock=machine.clock, set_threads=machine.set_threads
    )


def test_a_busy_machine_steps_with_one_thread_and_says_so():
    machine, logged = FakeMachine({2: 2.4, 1: 0.16}), []
    chooser = _chooser(machine, logged)
    machine.steps(chooser, 60)
    assert machine.threads == 1
    assert machine.history[-40:] == [1] * 40
    # two threads are ruled out after a single timed step: each costs 15 of the other
    assert machine.history.count(2) <= 2 + 3 + 1
    assert len(logged) == 1 and logged[0].startswith("threads: 1 ")


def test_a_quiet_machine_keeps_every_core():
    machine, logged = FakeMachine({2: 0.1, 1: 0.16}), []
    machine.steps(_chooser(machine, logged), 60)
    assert machine.threads == 2 and machine.history[-40:] == [2] * 40
    assert logged and logged[0].startswith("threads: 2 ")


def test_the_load_arriving_midway_is_noticed_and_the_count_changes():
    machine, logged = FakeMachine({2: 0.1, 1: 0.16}), []
    chooser = _chooser(machine, logged)
    machine.steps(chooser, 40)
    assert machine.threads == 2
    machine.seconds = {2: 2.4, 1: 0.2}  # a neighbour starts spinning on the CPU
    machine.steps(chooser, 40)
    assert machine.threads == 1 and machine.history[-20:] == [1] * 20
    assert [line.split()[1] for line in logged] == ["2", "1"]


def test_the_choice_is_off_when_the_user_set_threads_or_off_the_cpu():
    cpu, hook = torch.device("cpu"), object()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert wanted(cpu, False, env={})
        assert not wanted(cpu, False, env={"OMP_NUM_THREADS": "2"})
        assert not wanted(cpu, True, env={})  # torchrun: each rank keeps its share
        assert not wanted(torch.device("meta"), False, env={})
        torch.set_num_threads(1)
        assert not wanted(cpu, False, env={})  # nothing to choose
        assert thread_hook(cpu, False, print, then=hook) is hook
    finally:
        torch.set_num_threads(before)
