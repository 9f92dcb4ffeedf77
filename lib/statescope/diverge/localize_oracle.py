"""The float64 oracle against a digest capture: per request step, GDN layer and state kind.

What it does: ``oracle_frame`` runs ``statescope.diverge.oracle.gdn_states`` over one request's
prompt and output tokens and compares, at each captured request step, the oracle's recurrent state
(digested with the capture's own ``Digester`` weights: sum, sumsq, proj0-2) and its conv input rows
(bf16-rounded row sums) with what the capture recorded, giving rows in
``statescope.diverge.noise.compare_states``' columns, so ``noise.calibrate``/``in_units`` apply as
they are. Positions come from the runner-side computed count; an in-place post-process left shift
by ``b`` (census) moves conv row ``j + b`` to row ``j`` and draft column ``b``'s recurrent state into
the running column, and the expected positions follow it. ``gdn_layers`` maps the capture's GDN
layer names to model layer indices.

What it deliberately does not do: pick the requests or set a tolerance (``statescope.diverge.localize``
does), or read full snapshots (a digest capture is enough).
"""
from __future__ import annotations

import re
from typing import Any

import numpy as np
import pandas as pd

from statescope.errors import InputError

SSM_STATS = ["sum", "sumsq", "proj0", "proj1", "proj2"]
_LAYER_INDEX = re.compile(r"\.layers\.(\d+)\.")


def gdn_layers(digests: pd.DataFrame) -> dict[int, str]:
    """{model layer index: captured GDN layer name}, in layer order."""
    out = {}
    for name in digests["layer"].unique():
        m = _LAYER_INDEX.search(str(name))
        if m is None:
            raise InputError(f"capture digests: layer name {name!r} has no '.layers.<i>.' index")
        out[int(m.group(1))] = str(name)
    return dict(sorted(out.items()))


def oracle_frame(rid: str, m: pd.DataFrame, dig: pd.DataFrame, tokens: list[int], model: str,
                 digester: Any, bias: dict, layers: dict[int, str]) -> pd.DataFrame:
    """Per (step, layer, kind) of request ``rid``: abs differences of the capture from the oracle,
    in ``statescope.diverge.noise.compare_states``' columns (``parts`` NaN where not comparable)."""
    import torch

    from statescope.diverge.oracle import gdn_states

    lo = int(m.num_computed_runner.min()) - 4
    positions = list(range(lo, len(tokens)))
    states = gdn_states(model, tokens, positions)
    at = {p: k for k, p in enumerate(positions)}
    zero = torch.zeros(1, 1, dtype=torch.long)
    out = []
    for s in m.itertuples():
        c, n, d, a = int(s.num_computed_runner), int(s.num_scheduled_tokens), int(s.num_drafts), int(s.accepted)
        if d == 0:  # prefill chunk: rows 0..2 = last 3 inputs, state after the last token
            ssm_pos, conv_pos = c + n - 1, {j: c + n - 3 + j for j in range(3)}
        else:  # decode: rows = c-2..c+2 (drafts), valid up to the last accepted one; an
            # in-place post-process shift by b moves row j+b to row j and the recurrent state
            # of draft column b into the running column
            b = bias.get((rid, int(s.engine_step)), 0)
            layout = {j: c - 2 + j + (b if j <= 4 - b else 0) for j in range(5)}
            ssm_pos, conv_pos = c + b, {j: p for j, p in layout.items() if p <= c + a - 1}
        for li, name in layers.items():
            got = dig[(dig.req_id == rid) & (dig.req_step == s.req_step) & (dig.layer == name)]
            for kind in ("conv", "ssm"):
                g = got[got.kind == kind]
                if g.empty:
                    continue
                g = g.iloc[0]
                if kind == "ssm":
                    if ssm_pos not in at:
                        continue
                    ref = states[li][at[ssm_pos]][1].float()  # (h, v, k) layout: matches as is
                    st, _ = digester.digest([ref.unsqueeze(0)], zero)
                    refv = np.array([float(st[0, 0, digester.names.index(x)]) for x in SSM_STATS])
                    parts = np.abs(np.array([float(g[x]) for x in SSM_STATS]) - refv)
                    scale, pos = float(np.abs(refv).max()), ssm_pos
                else:
                    diffs, scale = [], 0.0
                    for j in range(5):
                        p = conv_pos.get(j)
                        if p is None or p not in at:
                            diffs.append(float("nan"))
                            continue
                        ref_row = states[li][at[p]][0][-1].to(torch.bfloat16).float()
                        diffs.append(abs(float(g.row_sums[j]) - float(ref_row.sum())))
                        scale = max(scale, float(ref_row.abs().sum()))
                    parts, pos = np.array(diffs), max(conv_pos.values())
                finite = parts[np.isfinite(parts)]
                out.append({"req_id": rid, "req_step": int(s.req_step), "engine_step": int(s.engine_step),
                            "position": int(pos), "layer": name, "kind": kind,
                            "max_abs": float(finite.max()) if len(finite) else float("nan"),
                            "parts": [float(x) for x in parts], "scale": scale,
                            "nan_or_inf": bool(g["nan"] or g["inf"])})
    return pd.DataFrame(out)
