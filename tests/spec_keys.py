"""Tests' spec dicts with keys set by path: {"capture__lazy": False} sets raw["capture"]["lazy"]."""


def with_keys(raw: dict, over: dict) -> dict:
    """raw, with each key of `over` (parts joined by "__") set to its value; returns raw."""
    for key, value in over.items():
        node = raw
        *parents, last = key.split("__")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    return raw
