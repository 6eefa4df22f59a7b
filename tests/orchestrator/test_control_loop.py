"""The orchestrator's control loop: a pure scheduler over an injected clock."""

from expertmesh.orchestrator.control_loop import ControlLoop, Manager


class Clock:
    now = 0.0

    def __call__(self):
        return self.now


def test_each_manager_runs_on_its_own_interval_and_a_failure_stops_nothing():
    clock, calls = Clock(), []

    def broken():
        calls.append("health")
        raise RuntimeError("a group did not answer")

    loop = ControlLoop(
        [
            Manager("reconcile", 1.0, lambda: calls.append("reconcile")),
            Manager("health", 3.0, broken),
            Manager("drift", 2.0, lambda: calls.append("drift")),
        ],
        clock=clock,
    )
    assert loop.step() == []
    ran = []
    for t in (1.0, 2.0, 3.0, 4.0):
        clock.now = t
        ran.append(loop.step())
    assert ran == [["reconcile"], ["reconcile", "drift"], ["reconcile", "health"], ["reconcile", "drift"]]
    assert calls.count("health") == 1


def test_start_and_stop_run_steps_in_a_thread():
    import threading

    done = threading.Event()
    loop = ControlLoop([Manager("once", 0.0, done.set)], tick_s=0.01).start()
    assert done.wait(5)
    loop.stop()
