"""A :class:`~.hardware.Hardware` written as TOML (what ``dtp plan --calibrate`` prints, and
``--hardware FILE`` reads back with :func:`~.hardware.from_toml`): :func:`to_toml`."""

from __future__ import annotations

import json
from typing import Any

from .hardware import _LINKS, Hardware, Link

__all__ = ["to_toml"]


def _value(v: Any) -> str:
    """One TOML value: floats by ``repr`` (exact round trip), strings JSON-escaped (a JSON
    string is a TOML basic string), tuples as arrays."""
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)
    if isinstance(v, bool):
        raise TypeError("no booleans in hardware")
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return repr(v)  # 'inf'/'nan' cannot occur: every figure was checked finite
    return "[" + ", ".join(_value(x) for x in v) + "]"


def to_toml(hw: Hardware) -> str:
    """``hw`` as TOML (:func:`from_toml` reads it back equal).

    >>> from dtp.planning.hardware import PRESETS, from_toml
    >>> text = to_toml(PRESETS["a100-80gb"])
    >>> print(text.splitlines()[0]); from_toml(text) == PRESETS["a100-80gb"]
    name = "a100-80gb"
    True
    """
    c = hw.chip
    lines = [f"name = {_value(hw.name)}", f"devices_per_node = {hw.devices_per_node}",
             f"source = {_value(hw.source)}", "",
             "# one device; bytes, bytes/s, FLOP/s", "[chip]", f"name = {_value(c.name)}",
             f"memory = {_value(float(c.memory))}", f"memory_bandwidth = {_value(float(c.memory_bandwidth))}",
             f"matmul_efficiency = {_value(float(c.matmul_efficiency))}"]
    if c.matmul_curve:
        lines.append("# (m*n*k, fraction of peak) of GEMMs of growing size")
        lines.append(f"matmul_curve = {_value([[float(s), float(f)] for s, f in c.matmul_curve])}")
    if c.attention_curve:
        lines.append("# (seq*head_dim, fraction of peak) of causal attention, forward and backward")
        lines.append(f"attention_curve = {_value([[float(s), float(f)] for s, f in c.attention_curve])}")
    if c.op_overhead:
        lines.append(f"op_overhead = {_value(float(c.op_overhead))}  # seconds per op, beyond its bytes and FLOPs")
    lines += ["", "[chip.flops]"] + [f"{k} = {_value(float(v))}" for k, v in c.flops.items()]
    for key in _LINKS:
        link: Link = getattr(hw, key)
        lines += ["", f"[{key}]  # bytes/s each way, seconds per message, realised fraction of the bandwidth",
                  f"bandwidth = {_value(float(link.bandwidth))}", f"latency = {_value(float(link.latency))}",
                  f"efficiency = {_value(float(link.efficiency))}"]
        if link.collective_latency:
            lines.append("# [kind, ranks, seconds] of a small collective, every group at once")
            rows = ", ".join(f"[{_value(k)}, {n}, {_value(float(t))}]" for k, n, t in link.collective_latency)
            lines.append(f"collective_latency = [{rows}]")
    return "\n".join(lines) + "\n"
