"""A profile calibrated before the draft-pass term, its decode entries refitted with it (analysis, not shipped).

    python bench/data/simulate/gpu-h100-2026-12-07-d/refit_draft_passes.py PROFILE OUT K

The engine-alone steps were recorded without their proposed drafts; they are taken from the order of the steps: a
step's drafts are verified in the same request's next step, so the next step's tokens per request less one (at most
K; a batch's last step: none). Exact where a batch's requests move in step (the GLM widths: acceptance 1.0),
approximate where they drift apart (tiny-code: acceptance 1.9). The served fit then takes the term from there.
"""

import json
import math
import sys

from bench.simulate.calibrate import FIT_TERMS, nnls_fit, served_decode_fit


def same_batch(a: list, b: list) -> bool:
    """Consecutive steps of one batch: no more requests, about the same context per request."""
    return b[3] <= a[3] and abs(b[4] / b[3] - a[4] / a[3]) <= 16


def main(src: str, out: str, k: int) -> None:
    p = json.load(open(src))
    key = next(x for x in p["engines"] if x.startswith("decode"))
    served = p["engines"][key]
    eo = served["engine_only"]
    rows = eo["measured"]
    new = []
    for i, r in enumerate(rows):
        nxt = rows[i + 1] if i + 1 < len(rows) else None
        d = min(k, max(0, math.ceil(nxt[1] / nxt[3]) - 1)) if nxt is not None and same_batch(r, nxt) else 0
        new.append(([*r[:5], float(d)], r[5]))
    coef, rel = nnls_fit(new, relative=True)
    eo2 = {**dict(zip(FIT_TERMS, coef)), "median_relative_error": rel}
    print(key, "engine alone:", {t: round(c, 7) for t, c in zip(FIT_TERMS, coef)},
          f"median |error| {eo['median_relative_error']:.3f} -> {rel:.3f}")
    srows = [([*r[:5], float(k)], r[5]) for r in served["measured"]]
    scoef, srel = served_decode_fit(srows, eo2)
    print(key, "served:", {t: round(c, 7) for t, c in zip(FIT_TERMS, scoef)}, f"median |error| {srel:.3f}")
    served.update(dict(zip(FIT_TERMS, scoef)), median_relative_error=srel, measured=[[*f, t] for f, t in srows],
                  engine_only={**eo, **eo2, "measured": [[*f, t] for f, t in new]})
    served["source"] += ("; refitted offline with the draft-pass term (each engine-alone step's proposed drafts "
                         "taken from the next step's tokens per request)")
    json.dump(p, open(out, "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
