"""Lesson 9 exercise: split a step's communication time into exposed and hidden.

    refpar lesson check 9

A rank's trace gives each message a span (start, end) in seconds: a blocking collective's from its
call to its return (the rank can do nothing else meanwhile), an isend's or irecv's from its post to
its completion (the rank computes until it calls wait()). `waits` are the (start, end) of the rank's
calls to wait(). Return three numbers of seconds:

- in_flight: how long at least one message was in flight;
- exposed: how long the rank was blocked by communication, in a blocking call or in a wait;
- hidden: in_flight - exposed, the time messages travelled while the rank computed.

Spans overlap: the isend and the irecv of one ring round are in flight together, and a blocking
call may run while an earlier isend is still on its way.
"""


def exposed_and_hidden(messages: list[tuple[float, float, bool]],
                       waits: list[tuple[float, float]]) -> tuple[float, float, float]:
    """messages: (start, end, blocking) of each; waits: (start, end) of each wait() call.
    Returns (in_flight, exposed, hidden)."""
    # ---- your part ------------------------------------------------------------------------------
    raise NotImplementedError("write exposed_and_hidden(messages, waits)")
    # ---- end of your part -----------------------------------------------------------------------
