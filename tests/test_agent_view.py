"""The validator's and the agent's view of the program (gpuos_tools/agent/view.py), fed the same
wire tuples the tracer ships, without a GPU."""

from gpuos_tools.model import wire
from gpuos_tools.agent.view import ProcessView


def test_allocations_copies_and_streams():
    v = ProcessView()
    v.observe((wire.ALLOC, 1, 1, 0, 0x1000, 256, "device", 0))
    v.observe((wire.ALLOC, 2, 1, 0, 0x2000, 512, "host", 0))
    v.observe((wire.ALLOC, 3, 1, 0, 0x3000, 4096, "device", 0))
    v.observe((wire.STREAM, 4, 1, 77, "create"))
    # a pointer array copied from the host into allocation 1, on stream 77
    v.observe((wire.COPY, 5, 1, 0, "HtoD", 0x1000, 0x9999, 8, 77, True, None, (0x3010).to_bytes(8, "little")))
    assert [a.id for a in v.device_allocations()] == [1, 3]
    assert v.streams == {0, 77}
    assert v.pred.contents[1] == [(0, (0x3010).to_bytes(8, "little"))]
    # a launch reaching allocation 1 reaches allocation 3 through the array
    acc = v.pred.launch({"kernel": "k", "params": [{"size": 8, "hex": (0x1000).to_bytes(8, "little").hex()}]})[0]
    assert {e["alloc"] for e in acc["writes"]} == {1, 3}
    v.observe((wire.SET, 6, 1, 0, 0x1000, 8, 0, 1, 0, False))  # overwritten on the GPU: forgotten
    assert 1 not in v.pred.contents
    v.observe((wire.FREE, 7, 1, 0, 0x3000, -1, 0))
    v.observe((wire.STREAM, 8, 1, 77, "destroy"))
    assert [a.id for a in v.device_allocations()] == [1] and 3 not in v.by_id
    assert v.streams == {0}


def test_launch_record_slices_arguments_by_parameter_size():
    from gpuos_tools.agent.view import launch_record

    rec = launch_record("k", (8, 4), bytes(range(12)))
    assert rec == {"kernel": "k", "params": [{"size": 8, "hex": bytes(range(8)).hex()},
                                             {"size": 4, "hex": bytes(range(8, 12)).hex()}]}
    assert launch_record("k", None, None)["layout"] == "none"


def test_settle_waits_for_operations_being_issued():
    """T0 and rollbacks wait until every operation past its enter callback reached its exit."""
    import threading
    import time

    from gpuos_tools.agent.agent import Agent

    agent = Agent()
    assert agent.settle(timeout=0.01) == 0
    agent.issue_begin()
    agent.issue_begin()
    assert agent.settle(timeout=0.01) == 2  # an exit that never comes: reported, not waited for forever

    def exits():
        time.sleep(0.05)
        agent.issue_end()
        agent.issue_end()

    t = threading.Thread(target=exits)
    t.start()
    start = time.monotonic()
    assert agent.settle(timeout=5) == 0 and time.monotonic() - start < 4
    t.join()
    agent.issue_end()  # one too many never goes below zero
    assert agent.issuing == 0
