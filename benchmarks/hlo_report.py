"""Checks of a compiled step's HLO text: the KV pool is donated and never copied or sliced, and the
step's fresh inputs are read once (so CUDA-graph nodes keep their buffer addresses). Used by
``check_step_hlo.py`` on a GPU and by ``tests/engine/test_runner.py``."""

from __future__ import annotations

import re


def pool_hlo_report(hlo: str, pool_shape: tuple[int, ...]) -> dict:
    """How a compiled step (``hlo``: its text) treats the pool ``[L, N, bs, 2, Hkv, D]``.

    ``aliased``: pool-shaped parameters aliased to outputs (the donated pool: 1); ``aliases``: all
    parameters aliased to outputs (the pool and the recycled token buffer: 2). ``copies``: copies of the whole
    pool. ``slices``: values holding part of the pool, i.e. any array with the pool's ``N, bs`` axes that
    is not the pool itself (a layer, ``[1, N, ...]``, keys only, ...): XLA copies a slice before a custom
    call, so the step must index the pool, never slice it. Both must be 0.
    """
    lines = hlo.splitlines()
    dims = ",".join(map(str, pool_shape))
    n, bs = pool_shape[1], pool_shape[2]
    copies = sum(1 for ln in lines if re.search(rf"\w+\[{dims}\]", ln) and re.search(r"\bcopy(-start)?\(", ln))
    slices = 0
    for ln in lines:
        m = re.search(r"= \w+\[([\d,]+)\]", ln)
        if m and m.group(1) != dims and re.search(rf"(^|,){n},{bs}(,|$)", m.group(1)):
            slices += 1
    aliased_params = [int(k) for k in re.findall(r"\{\d+\}: \((\d+), \{\}, (?:may|must)-alias\)", lines[0])]
    pool_params = {int(m.group(1)) for ln in lines
                   if (m := re.search(rf"= \w+\[{dims}\](?:\{{[\d,]*\}})? parameter\((\d+)\)", ln))}
    return dict(aliased=sum(1 for k in aliased_params if k in pool_params), aliases=len(aliased_params),
                copies=copies, slices=slices)


def entry_param_readers(hlo: str, params: list[int]) -> dict[int, int]:
    """How many instructions of a compiled step's entry computation read each of its parameters
    ``params`` (numbers as in ``parameter(K)``). The step's packed inputs and previous tokens must be
    read by one each (``transfer.to_step_memory``'s copy), or every launch patches the CUDA graph's
    nodes that read them."""
    lines = hlo.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("ENTRY"))
    body = []
    for ln in lines[start + 1:]:
        if ln.startswith("}"):
            break
        body.append(ln)
    names = {}
    for ln in body:
        m = re.search(r"(%[\w.\-]+) = [^=]*\bparameter\((\d+)\)", ln)
        if m and int(m.group(2)) in params:
            names[int(m.group(2))] = m.group(1)
    return {k: sum(1 for ln in body if "parameter(" not in ln and re.search(re.escape(name) + r"(?![\w.\-])", ln))
            for k, name in names.items()}
