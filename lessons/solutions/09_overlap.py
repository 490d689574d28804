"""Lesson 9, reference solution: a step's communication time, exposed and hidden."""


def _covered(spans) -> float:
    """Seconds covered by at least one (start, end): sweep the spans in order of their start."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > reach:  # the part beyond what earlier spans already covered
            total += end - max(start, reach)
            reach = end
    return total


def exposed_and_hidden(messages, waits):
    in_flight = _covered([(s, e) for s, e, _ in messages])
    exposed = _covered([(s, e) for s, e, blocking in messages if blocking] + list(waits))
    return in_flight, exposed, in_flight - exposed
