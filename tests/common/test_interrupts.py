"""Signals held while the main thread runs a cycle (common/interrupts.py), with real signals."""

from __future__ import annotations

import signal

import pytest

from hpc_horovod.common.interrupts import HeldSignals


class Raised(Exception):
    pass


@pytest.fixture
def raising_handler():
    """SIGUSR1's handler raises Raised; the previous handler is put back afterwards."""
    seen = []

    def handler(signum, frame):
        seen.append(signum)
        raise Raised(f"signal {signum}")

    previous = signal.signal(signal.SIGUSR1, handler)
    yield handler, seen
    signal.signal(signal.SIGUSR1, previous)


def test_a_signal_during_the_cycle_is_handled_after_it(raising_handler):
    handler, seen = raising_handler
    steps = []
    with pytest.raises(Raised):
        with HeldSignals():
            signal.raise_signal(signal.SIGUSR1)
            steps.append("the cycle went on")
            assert not seen
    assert steps == ["the cycle went on"] and seen == [signal.SIGUSR1]
    assert signal.getsignal(signal.SIGUSR1) is handler


def test_a_second_signal_is_handled_at_once(raising_handler):
    handler, seen = raising_handler
    steps = []
    with pytest.raises(Raised):
        with HeldSignals():
            signal.raise_signal(signal.SIGUSR1)
            steps.append("held")
            signal.raise_signal(signal.SIGUSR1)
            steps.append("not reached")
    assert steps == ["held"] and seen == [signal.SIGUSR1]
    assert signal.getsignal(signal.SIGUSR1) is handler


def test_without_signals_the_handlers_are_the_same_after(raising_handler):
    handler, seen = raising_handler
    before = {s: signal.getsignal(s) for s in signal.valid_signals() if s < 32}
    with HeldSignals():
        assert signal.getsignal(signal.SIGUSR1) is not handler
    assert {s: signal.getsignal(s) for s in signal.valid_signals() if s < 32} == before
    assert not seen
