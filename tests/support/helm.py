"""Helm's value coalescing, for validating our values merged over a chart's defaults."""

import copy


def merge(base: dict, over: dict) -> dict:
    """Maps merge key by key, a null deletes the key, everything else is replaced."""
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        elif value is None:
            out.pop(key, None)
        else:
            out[key] = copy.deepcopy(value)
    return out
